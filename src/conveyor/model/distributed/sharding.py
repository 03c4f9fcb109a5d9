"""Which slice of each weight a tensor-parallel rank holds (Megatron-style, as vLLM splits).

Each family declares how each weight splits, by its module's leaf name (FamilySpec.tp_splits,
model/models/spec.py). N ranks, rank r; H query heads, Hkv KV heads, head size d, V tokens;
a weight is [out, in]:

    split     rank r holds                                        Llama's weights
    heads     rows of heads r*H/N .. (r+1)*H/N - 1                self_attn.q_proj (and
                                                                  gpt-oss's sinks, a row a head)
    kv_heads  Hkv >= N: rows of KV heads r*Hkv/N ..; Hkv < N: the self_attn.k_proj, v_proj
              one KV head its query heads read (replicated)
    column    rows r*out/N .. (r+1)*out/N - 1                     mlp.gate_proj, up_proj
    row       columns r*in/N ..; + all_reduce                     self_attn.o_proj, mlp.down_proj
    vocab     rows r*Vr .. with Vr = ceil(V/N), the last rank's   embed_tokens, lm_head
              padded with zeros
    (none)    everything                                          norms, rotary

A bias follows its rows; a row-split bias is added once, by rank 0 (the others hold zeros),
so the all-reduce sums it once. Every slice is a `narrow` of the checkpoint tensor: with the
mmap loader a rank reads only its own pages of the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# A mixture of experts' intermediate sizes (ModelConfig; 0 where there is none).
_EXPERT_SIZES = ("moe_intermediate_size", "shared_expert_intermediate_size")


def check_tensor_parallel(config: Any, size: int) -> None:
    """Refuse a split the model's shapes do not allow (ValueError with the numbers).

    Args:
        config: a ModelConfig (num_attention_heads, num_key_value_heads, intermediate_size).
        size: tensor_parallel_size.
    """
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's {heads} attention heads: "
            "choose a size that divides it."
        )
    if (kv_heads % size) if kv_heads >= size else (size % kv_heads):
        raise ValueError(
            f"tensor_parallel_size {size} and the model's {kv_heads} KV heads do not fit: the "
            "size must divide the KV heads, or be a multiple of them (KV heads replicated)."
        )
    for name in ("intermediate_size", *_EXPERT_SIZES):
        width = getattr(config, name, 0)
        if width % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's {name} {width}."
            )


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's slice of a model of `config`'s shapes, split as its family declares (see
    the module docstring)."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    splits: Mapping[str, str] = field(hash=False)  # module leaf -> split (FamilySpec)

    @classmethod
    def of(cls, config: Any, rank: int, size: int, splits: Mapping[str, str]) -> Shard:
        """`config`: a ModelConfig; `splits`: the family's FamilySpec.tp_splits."""
        check_tensor_parallel(config, size)
        return cls(
            rank, size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.vocab_size, splits,
        )  # fmt: skip

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def local_vocab(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_vocab

    def local_config(self, config: Any) -> Any:
        """`config` (a dataclass) with this rank's head, MLP and vocabulary sizes: what its
        modules and its KV cache are built from."""
        return dataclasses.replace(
            config,
            num_attention_heads=self.local_heads,
            num_key_value_heads=self.local_kv_heads,
            intermediate_size=self.intermediate_size // self.size,
            vocab_size=self.local_vocab,
            # Each expert's intermediate dimension is split like a dense MLP's.
            **{n: getattr(config, n) // self.size for n in _EXPERT_SIZES if hasattr(config, n)},
        )

    def _kv_head_start(self) -> int:
        if self.num_kv_heads >= self.size:
            return self.rank * self.local_kv_heads
        # Replicated: the KV head that this rank's first query head belongs to.
        return self.rank * self.local_heads // (self.num_heads // self.num_kv_heads)

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (an HF name, before the packed
        weights are fused), split as `splits` says for its module's leaf: a view where it can
        be one."""
        parts = name.split(".")
        # by its module's leaf, or a parameter's own name (gpt-oss's self_attn.sinks)
        split = self.splits.get(parts[-2] if len(parts) >= 2 else "") or self.splits.get(parts[-1])
        d = self.head_dim
        if split == "vocab":
            return self._vocab_rows(tensor)
        if split == "heads":  # d rows a head (q_proj), or one (sinks)
            rows = tensor.shape[0] // self.num_heads
            return tensor.narrow(0, self.rank * self.local_heads * rows, self.local_heads * rows)
        if split == "kv_heads":
            return tensor.narrow(0, self._kv_head_start() * d, self.local_kv_heads * d)
        if split == "column":
            width = tensor.shape[0] // self.size
            return tensor.narrow(0, self.rank * width, width)
        if split == "row":
            if parts[-1] == "bias":
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            width = tensor.shape[1] // self.size
            return tensor.narrow(1, self.rank * width, width)
        return tensor

    def _vocab_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        start, rows = self.vocab_start, self.local_vocab
        held = max(0, min(rows, tensor.shape[0] - start))
        part = tensor.narrow(0, min(start, tensor.shape[0]), held)
        if held == rows:
            return part
        return torch.cat([part, part.new_zeros(rows - held, *tensor.shape[1:])])


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding; ids outside them look up zeros, and the all-reduce
    over the ranks puts every id's row together."""

    def __init__(self, shard: Shard, hidden_size: int, group: Any) -> None:
        super().__init__(shard.local_vocab, hidden_size)
        self.vocab_start = shard.vocab_start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(1), 0.0)
        return self.group.all_reduce(out)
