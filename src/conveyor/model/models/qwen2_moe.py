"""Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2's attention (q/k/v biases) with a mixture of
experts in the sparse layers (models/moe.py) plus a shared expert every token runs, scaled
by a sigmoid gate of its own."""

from __future__ import annotations

import dataclasses

from torch import nn

from conveyor.model.loading.model_config import ModelConfig
from conveyor.model.models.llama import Qwen2ForCausalLM
from conveyor.model.models.moe import MoEBlock

# llama.cpp's names of the router and of the shared expert and its gate.
_MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_QWEN2_GGUF = Qwen2ForCausalLM.SPEC.gguf


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    SPEC = dataclasses.replace(
        Qwen2ForCausalLM.SPEC,
        architectures=("Qwen2MoeForCausalLM",),
        gguf=dataclasses.replace(
            _QWEN2_GGUF,  # type: ignore[arg-type]
            architecture="qwen2moe",
            layer_names={**_QWEN2_GGUF.layer_names, **_MOE_LAYER_NAMES},  # type: ignore[union-attr]
            experts="mlp.experts.{e}",
        ),
    )

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module | None:
        if not config.is_sparse(layer):
            return None
        return MoEBlock(config, norm_topk=config.norm_topk_prob, weights_in_float=False)
