"""Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2's attention (q/k/v biases) with a mixture of
experts in the sparse layers (models/moe.py) plus a shared expert every token runs, scaled
by a sigmoid gate of its own."""

from __future__ import annotations

import dataclasses

from torch import nn

from conveyor.model.loading.model_config import ModelConfig
from conveyor.model.models.llama import Qwen2ForCausalLM
from conveyor.model.models.moe import MoEBlock


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    SPEC = dataclasses.replace(
        Qwen2ForCausalLM.SPEC, architectures=("Qwen2MoeForCausalLM",), gguf=None
    )

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module | None:
        if not config.is_sparse(layer):
            return None
        return MoEBlock(config, norm_topk=config.norm_topk_prob, weights_in_float=False)
