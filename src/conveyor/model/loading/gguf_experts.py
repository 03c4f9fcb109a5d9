"""A mixture of experts in a llama.cpp GGUF file: its metadata as config.json keys, and its
3-D expert tensors as the per-expert weights the HF checkpoint has.

    GGUF (llama.cpp's converter)              HF / ours
    {arch}.expert_count                       num_experts
    {arch}.expert_used_count                  num_experts_per_tok
    {arch}.expert_feed_forward_length         moe_intermediate_size
    {arch}.expert_shared_feed_forward_length  shared_expert_intermediate_size
    {arch}.expert_weights_norm                norm_topk_prob (absent: as llama.cpp does for
                                              the architecture: qwen3moe and llama
                                              (Mixtral) renormalize, qwen2moe and olmoe
                                              do not)
    layers with ffn_gate, no ffn_gate_exps    mlp_only_layers (dense layers)
    blk.N.ffn_{gate,up,down}_exps [E, rows, cols]   model.layers.N.mlp.experts.{e}.
                                                    {gate,up,down}_proj.weight [rows, cols]

The router (`ffn_gate_inp`) and Qwen2-MoE's shared expert (`ffn_*_shexp`) are 2-D tensors in
the family's layer names (GGUFNames). A quantized expert tensor's rows are whole blocks, so
each expert's slice is its own rows' bytes, kept quantized like any linear's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from conveyor.model.loading.gguf_file import GGUFFile, GGUFTensor
from conveyor.model.loading.gguf_metadata import describe

# The GGUF layer part of an expert tensor -> the HF leaf of each expert's linear.
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                  "ffn_down_exps": "down_proj"}  # fmt: skip
# llama.cpp's routing where the file does not say (its graph builders' choice).
_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False, "llama": True, "olmoe": False}
MAX_EXPERTS = 1 << 12


def gguf_expert_config(
    file: str | os.PathLike[str], reader: GGUFFile, arch: str, hidden: int
) -> dict[str, Any]:
    """config.json's mixture-of-experts keys from the metadata ({} for a dense file),
    checked against the expert tensors.

    Raises:
        ValueError: a count out of range, or sizes that do not match the tensors.
    """
    meta = reader.metadata
    count = meta.get(f"{arch}.expert_count", 0)
    if count in (0, None):
        return {}

    def integer(name: str, value: Any, lo: int, hi: int) -> int:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, np.integer))
            or not (lo <= value <= hi)
        ):
            raise ValueError(
                f"GGUF file {file}: {arch}.{name} is {describe(value)}; it must be an integer "
                f"from {lo} to {hi}."
            )
        return int(value)

    count = integer("expert_count", count, 1, MAX_EXPERTS)
    used = integer("expert_used_count", meta.get(f"{arch}.expert_used_count"), 1, count)
    gate = _first(reader, "ffn_gate_exps")
    if gate is None or len(gate.shape) != 3:
        raise ValueError(
            f"GGUF file {file} says {arch}.expert_count is {count} but has no 3-D "
            "blk.N.ffn_gate_exps tensor."
        )
    experts, rows, cols = gate.shape
    size = integer(
        "expert_feed_forward_length", meta.get(f"{arch}.expert_feed_forward_length", rows),
        1, 1 << 20,
    )  # fmt: skip
    if (experts, rows, cols) != (count, size, hidden):
        raise ValueError(
            f"GGUF file {file}: {gate.name} has shape {list(gate.shape)}; with "
            f"{arch}.expert_count {count}, expert_feed_forward_length {size} and "
            f"embedding_length {hidden} it should be {[count, size, hidden]}."
        )
    # Layers without experts are dense (Qwen3-MoE's mlp_only_layers; GGUF has no key for it).
    sparse = {int(t.name.split(".")[1]) for t in reader.tensors if _part(t) == "ffn_gate_exps"}
    dense = {int(t.name.split(".")[1]) for t in reader.tensors if _part(t) == "ffn_gate"}
    config = {
        "mlp_only_layers": sorted(dense - sparse),
        "num_experts": count, "num_experts_per_tok": used, "moe_intermediate_size": size,
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", _NORM_TOPK[arch])),
    }  # fmt: skip
    shared = _first(reader, "ffn_gate_shexp")
    if shared is not None:
        config["shared_expert_intermediate_size"] = integer(
            "expert_shared_feed_forward_length",
            meta.get(f"{arch}.expert_shared_feed_forward_length", shared.shape[0]), 1, 1 << 20,
        )  # fmt: skip
    return config


def _part(tensor: GGUFTensor) -> str | None:
    """A layer tensor's part (`ffn_gate_exps` of blk.3.ffn_gate_exps.weight), else None."""
    parts = tensor.name.split(".")
    return parts[2] if len(parts) == 4 and parts[0] == "blk" else None


def _first(reader: GGUFFile, part: str) -> GGUFTensor | None:
    return next((t for t in reader.tensors if _part(t) == part), None)


def split_experts(
    name: str, values: np.ndarray, pattern: str
) -> Iterator[tuple[str, np.ndarray]] | None:
    """The per-expert (HF name, values) of the expert tensor `name` (None: not one).

    Args:
        values: the tensor's [E, rows, ...] array (float32 values or the blocks' bytes).
        pattern: the family's HF module of an expert, with `{e}` (GGUFNames.experts).
    """
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in EXPERT_TENSORS:
        return None
    leaf = EXPERT_TENSORS[parts[2]]
    prefix = f"model.layers.{parts[1]}"
    return (
        (f"{prefix}.{pattern.format(e=e)}.{leaf}.{parts[3]}", np.ascontiguousarray(values[e]))
        for e in range(values.shape[0])
    )
