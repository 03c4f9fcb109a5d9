"""The decoder families (llama.py: Llama, Mistral, Qwen2, Qwen3), their layers and what each
declares (spec.py).

`FAMILIES` is the one registry: hf_config.py's MODEL_REGISTRY (config.json architectures) and
the GGUF reader's GGUF_ARCHITECTURES are read from each class's `SPEC`. A new family is its
module and one line here."""

from conveyor.model.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

FAMILIES: tuple[type[LlamaForCausalLM], ...] = (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
