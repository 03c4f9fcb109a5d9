"""Which slice of each weight a tensor-parallel rank holds (Megatron-style, as vLLM splits).

N ranks, rank r; H query heads, Hkv KV heads, head size d, MLP width I, vocabulary V:

    weight (HF name)                  split                 rank r holds
    self_attn.q_proj   [H*d, h]       column (rows here)    heads r*H/N .. (r+1)*H/N - 1
    self_attn.k/v_proj [Hkv*d, h]     column                Hkv >= N: heads r*Hkv/N ..;
                                                            Hkv < N: the one KV head its query
                                                            heads read (replicated)
    self_attn.o_proj   [h, H*d]       row (columns)         its heads' columns; + all_reduce
    mlp.gate/up_proj   [I, h]         column                rows r*I/N .. (r+1)*I/N - 1
    mlp.down_proj      [h, I]         row                   those columns; + all_reduce
    embed_tokens, lm_head [V, h]      vocabulary            rows r*Vr .. with Vr = ceil(V/N),
                                                            the last rank's padded with zeros
    norms (incl. Qwen3 q/k norm), rotary                    replicated

q/k/v biases (Qwen2) follow their rows; a row-parallel bias is added once, by rank 0 (the
others hold zeros), so the all-reduce sums it once. Every slice is a `narrow` of the
checkpoint tensor: with the mmap loader a rank reads only its own pages of the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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
    if config.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's intermediate_size "
            f"{config.intermediate_size}."
        )


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's slice of a model of `config`'s shapes (see the module docstring)."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: Any, rank: int, size: int) -> Shard:
        check_tensor_parallel(config, size)
        return cls(
            rank, size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.vocab_size,
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
        )

    def _kv_head_start(self) -> int:
        if self.num_kv_heads >= self.size:
            return self.rank * self.local_kv_heads
        # Replicated: the KV head that this rank's first query head belongs to.
        return self.rank * self.local_heads // (self.num_heads // self.num_kv_heads)

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (an HF name, before q/k/v and
        gate/up are fused): a view where it can be one."""
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        d = self.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self._vocab_rows(tensor)
        if module == "q_proj":
            return tensor.narrow(0, self.rank * self.local_heads * d, self.local_heads * d)
        if module in ("k_proj", "v_proj"):
            return tensor.narrow(0, self._kv_head_start() * d, self.local_kv_heads * d)
        if module in ("gate_proj", "up_proj"):
            width = self.intermediate_size // self.size
            return tensor.narrow(0, self.rank * width, width)
        if module in ("o_proj", "down_proj"):
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
