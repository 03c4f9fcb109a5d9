"""One step's attention metadata and the interface every attention backend implements.

The layout it describes is in conveyor.model.attention's docstring.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from conveyor.model.host_copy import to_device_int64

if TYPE_CHECKING:
    from conveyor.model.kv_cache import KVCache


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one step's varlen batch (built by the runner).

    Tensors live on the model's device; the `*_cpu` lists and max values are host copies so
    that no backend ever syncs with the device to learn a shape.
    """

    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token
    query_start_loc: torch.Tensor  # int32 [B+1]: cumulative new-token counts, batch order
    seq_lens: torch.Tensor  # int32 [B]: context length after this step (cached + new)
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # Optional: int64 [T] positions of the new tokens (runners may carry them here).
    positions: torch.Tensor | None = None
    # Per-step state a backend derives in the first layer and reuses in the others (the torch
    # backend's index plans by window, torch_attention.step_plan).
    backend_state: Any = field(default=None, repr=False, compare=False)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """One step's AttentionMetadata from host lists: `build_step_metadata` without extras."""
    return build_step_metadata(query_lens, seq_lens, block_tables, block_size, device)[0]


def build_step_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    extra: tuple[list[int], ...] = (),
) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """Build one step's AttentionMetadata from host lists (the runner's, every step).

    Positions and slots are computed in numpy on the host, then copied to `device` together
    (on CUDA in one non-blocking copy, host_copy.to_device_int64), with the caller's `extra`
    lists.

    Args:
        query_lens: new tokens per request, batch order (each >= 1).
        seq_lens: context length per request after this step (>= its query_len).
        block_tables: block ids per request, covering at least seq_len tokens.
        block_size: tokens per KV block.
        device: where the tensors go.
        extra: int lists the caller needs on `device` too (the runner's token ids and
            sampled rows), sent in the same copy.
    Returns:
        the metadata, positions included, and the `extra` lists as int64 tensors.
    Raises:
        ValueError: lists of different lengths, or a request shape that breaks the rules above.
    """
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables need one entry per request.")
    for q, s, t in zip(query_lens, seq_lens, block_tables, strict=True):
        if q < 1 or s < q or len(t) * block_size < s:
            raise ValueError(f"bad request shape: query_len={q}, seq_len={s}, blocks={len(t)}.")
    num_reqs = len(query_lens)
    q_lens = np.asarray(query_lens, dtype=np.int64)
    s_lens = np.asarray(seq_lens, dtype=np.int64)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    # position of token t = t - (start of its chunk in the flat batch) + (its first position)
    req_of_token = np.repeat(np.arange(num_reqs), q_lens)
    starts = query_start_loc[:-1] - (s_lens - q_lens)
    positions = np.arange(query_start_loc[-1]) - starts[req_of_token]
    tables = np.zeros((num_reqs, max(len(t) for t in block_tables)), dtype=np.int64)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    slots = tables[req_of_token, positions // block_size] * block_size + positions % block_size
    extras = (np.asarray(x, dtype=np.int64) for x in extra)
    parts = (slots, query_start_loc, s_lens, tables, positions, *extras)
    dev = to_device_int64(parts, torch.device(device))
    meta = AttentionMetadata(
        slot_mapping=dev[0],
        query_start_loc=dev[1].to(torch.int32),
        seq_lens=dev[2].to(torch.int32),
        block_tables=dev[3].to(torch.int32),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(s_lens.max()),
        positions=dev[4],
    )
    return meta, dev[5:]


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache and attends (one call per layer)."""

    name: ClassVar[str]

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]; stores k/v at meta.slot_mapping.

        window: the layer's sliding window (None: the whole context)."""
