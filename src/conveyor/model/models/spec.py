"""What a decoder family declares about itself, read by the loader, the tensor-parallel split
and the GGUF reader (each family's class holds one `FamilySpec` as `SPEC`). Pure Python.

    FamilySpec field   read by                          says
    architectures      loading/hf_config.py             the config.json `architectures` names
                       MODEL_REGISTRY                   it serves (its own first)
    config_names       loading/model_config.py          ModelConfig fields its config.json
                                                        names differently
    config_defaults    loading/hf_config.py             config.json values its transformers
                       model_config                     config class gives keys a file leaves
                                                        out, where ModelConfig's differ
    check_config       loading/hf_config.py             refuses, in one line, a ModelConfig
                       model_config                     the family cannot run as transformers
                                                        does (before anything loads)
    packed_modules     loading/loader.py                checkpoint weights fused into one
                                                        module (HF leaf -> (ours, index))
    renames            loading/loader.py                checkpoint module names that are
                                                        others of ours
    unstack            loading/assign_weights.py        a checkpoint tensor that is several
                                                        of ours (gpt-oss's stacked experts)
    tp_splits          model/distributed/sharding.py Shard       how tensor parallelism splits each
                                                        weight, by module leaf (SPLITS)
    gguf               loading/gguf_loader.py           its llama.cpp architecture and tensor
                                                        names (None: no GGUF files)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# How tensor parallelism splits a weight [out, in] (model/distributed/sharding.py; a leaf not
# named is replicated):
#   heads     rows, this rank's query heads            kv_heads  rows, this rank's KV heads
#   column    rows, an equal share                     row       columns, an equal share (its
#   vocab     rows, ceil(V / N) each, zero-padded                bias added by rank 0 only)
SPLITS = ("heads", "kv_heads", "column", "row", "vocab")

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True, slots=True)
class GGUFNames:
    """A family's llama.cpp GGUF file: its `general.architecture` and tensor names."""

    architecture: str
    # blk.N.<key>.{weight,bias} -> model.layers.N.<value>.{weight,bias}
    layer_names: Mapping[str, str]
    # <key>.{weight,bias} -> <value>.{weight,bias}
    global_names: Mapping[str, str]
    # llama.cpp's converter interleaved the rotary halves of q and k's rows (GGML's rope
    # order); the reader puts them back in HF's order.
    permuted_qk: bool = False
    # config.json's attention_bias: whether the file has a q_proj bias (else False).
    bias_from_tensors: bool = False
    # A mixture of experts: the HF module of expert {e}, which each 3-D blk.N.ffn_*_exps
    # tensor is split into (model/loading/gguf_experts.py); None: a dense family.
    experts: str | None = None

    def hf_name(self, name: str) -> str:
        """The HF name of a GGUF tensor name (unchanged if it is none of ours)."""
        match = _LAYER.fullmatch(name)
        if match:
            layer, part, leaf = match.groups()
            if part in self.layer_names:
                return f"model.layers.{layer}.{self.layer_names[part]}.{leaf}"
            return name
        base, _, leaf = name.rpartition(".")
        return f"{self.global_names[base]}.{leaf}" if base in self.global_names else name

    def gguf_name(self, hf_name: str) -> str:
        """The GGUF name of an HF tensor name (the inverse of hf_name)."""
        base, _, leaf = hf_name.rpartition(".")
        for ours, theirs in self.global_names.items():
            if theirs == base:
                return f"{ours}.{leaf}"
        prefix, _, rest = base.partition(".layers.")
        layer, _, module = rest.partition(".")
        for ours, theirs in self.layer_names.items():
            if prefix == "model" and theirs == module:
                return f"blk.{layer}.{ours}.{leaf}"
        return hf_name


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """One decoder family's declarations (see the module docstring)."""

    architectures: tuple[str, ...]
    # HF module leaf -> (our fused module, shard index); the loader concatenates the shards.
    packed_modules: Mapping[str, tuple[str, int]]
    # HF module leaf (or a parameter's own name: gpt-oss's sinks) -> one of SPLITS; leaves
    # not named are replicated.
    tp_splits: Mapping[str, str]
    # ModelConfig field -> the config.json key this family uses for it.
    config_names: Mapping[str, str] = field(default_factory=dict)
    gguf: GGUFNames | None = None
    # A checkpoint module name -> ours, for any component of a weight's name (Mixtral's
    # `block_sparse_moe` is our `mlp`), applied before `packed_modules`.
    renames: Mapping[str, str] = field(default_factory=dict)
    # (checkpoint name, tensor) -> the [(name, tensor)] it stands for, or None to keep it
    # as it is; applied before `renames` (gpt-oss's [E, ...] expert stacks: each expert's).
    unstack: Callable[[str, Any], list[tuple[str, Any]] | None] | None = None
    # config.json key -> the value transformers' config class gives it when the file leaves
    # it out (OLMoE's rms_norm_eps is 1e-5, ModelConfig's 1e-6).
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    # ModelConfig -> None, or ValueError (one line) for a config the family does not run.
    check_config: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tp_splits.values()) - set(SPLITS))
        if unknown:
            raise ValueError(f"tp_splits kinds {unknown} are none of {', '.join(SPLITS)}.")
