"""The decoder families (llama.py: Llama, Mistral, Qwen2, Qwen3) and their layers."""
