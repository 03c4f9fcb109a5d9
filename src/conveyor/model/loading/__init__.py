"""Checkpoints into models: the folder and file checks, safetensors and GGUF reading, the
config mapping, the weight assignment and the demo model. Imports nothing heavy by itself
(the server runs the checkpoint checks before any torch is loaded)."""
