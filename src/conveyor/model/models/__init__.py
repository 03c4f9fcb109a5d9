"""The decoder families (llama.py: Llama, Mistral, Qwen2, Qwen3; the mixtures of experts
qwen3_moe.py, qwen2_moe.py, mixtral.py, gpt_oss.py and olmoe.py, on moe.py), their layers and
what each declares (spec.py).

`FAMILIES` is the one registry: hf_config.py's MODEL_REGISTRY (config.json architectures) and
the GGUF reader's GGUF_ARCHITECTURES are read from each class's `SPEC`. A new family is its
module and one line here."""

from conveyor.model.models.gpt_oss import GptOssForCausalLM
from conveyor.model.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from conveyor.model.models.mixtral import MixtralForCausalLM
from conveyor.model.models.olmoe import OlmoeForCausalLM
from conveyor.model.models.qwen2_moe import Qwen2MoeForCausalLM
from conveyor.model.models.qwen3_moe import Qwen3MoeForCausalLM

FAMILIES: tuple[type[LlamaForCausalLM], ...] = (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    Qwen2MoeForCausalLM,
    MixtralForCausalLM,
    GptOssForCausalLM,
    OlmoeForCausalLM,
)
