"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k RMSNorm) with a mixture
of experts in the sparse layers (models/moe.py): 128 experts and top-8 in Qwen3-30B-A3B,
`norm_topk_prob`, `decoder_sparse_step` and `mlp_only_layers` as transformers reads them."""

from __future__ import annotations

import dataclasses

from torch import nn

from conveyor.model.loading.model_config import ModelConfig
from conveyor.model.models.llama import Qwen3ForCausalLM
from conveyor.model.models.moe import MoEBlock

_MOE_LAYER_NAMES = {"ffn_gate_inp": "mlp.gate"}  # llama.cpp's name of the router
_QWEN3_GGUF = Qwen3ForCausalLM.SPEC.gguf


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    SPEC = dataclasses.replace(
        Qwen3ForCausalLM.SPEC,
        architectures=("Qwen3MoeForCausalLM",),
        gguf=dataclasses.replace(
            _QWEN3_GGUF,  # type: ignore[arg-type]
            architecture="qwen3moe",
            layer_names={**_QWEN3_GGUF.layer_names, **_MOE_LAYER_NAMES},  # type: ignore[union-attr]
            experts="mlp.experts.{e}",
        ),
    )

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module | None:
        if not config.is_sparse(layer):
            return None
        return MoEBlock(config, norm_topk=config.norm_topk_prob, weights_in_float=False)
