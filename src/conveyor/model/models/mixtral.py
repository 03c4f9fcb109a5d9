"""Mixtral (`MixtralForCausalLM`): Mistral's attention with a mixture of experts in every
layer (models/moe.py): 8 experts, top-2, the two weights renormalized. Its checkpoint names
the block `block_sparse_moe` and each expert's linears w1 (gate), w3 (up) and w2 (down)."""

from __future__ import annotations

import dataclasses

from torch import nn

from conveyor.model.loading.model_config import ModelConfig
from conveyor.model.models.llama import MistralForCausalLM
from conveyor.model.models.moe import MoEBlock


class MixtralForCausalLM(MistralForCausalLM):
    SPEC = dataclasses.replace(
        MistralForCausalLM.SPEC,
        architectures=("MixtralForCausalLM",),
        packed_modules={
            **MistralForCausalLM.SPEC.packed_modules, "w1": ("gate_up_proj", 0),
            "w3": ("gate_up_proj", 1),
        },
        tp_splits={**MistralForCausalLM.SPEC.tp_splits, "w1": "column", "w3": "column"},
        config_names={"moe_intermediate_size": "intermediate_size"},
        renames={"block_sparse_moe": "mlp", "w2": "down_proj"},
    )  # fmt: skip

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module | None:
        return MoEBlock(config, norm_topk=True, weights_in_float=True)
