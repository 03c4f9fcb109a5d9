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

    Positions and slots are computed on the host (a decode step's in Python, a step with
    prefill chunks in numpy). On the CPU numpy's arrays become the tensors as they are; on CUDA
    every part and the caller's `extra` lists go in one non-blocking copy
    (host_copy.to_device_int64).

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
    device = torch.device(device)
    # On the CPU the tables are int32 at once; on CUDA they travel int64 with the rest.
    tables = np.zeros(
        (num_reqs, max(len(t) for t in block_tables)),
        dtype=np.int32 if device.type == "cpu" else np.int64,
    )
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    max_query_len = max(query_lens)
    if max_query_len == 1:  # decode rows: one new token each, at its context's last position
        query_start_loc: Any = range(num_reqs + 1)
        positions: Any = [s - 1 for s in seq_lens]
        slots: Any = [
            t[p // block_size] * block_size + p % block_size
            for t, p in zip(block_tables, positions, strict=True)
        ]
    else:
        q_lens = np.asarray(query_lens, dtype=np.int64)
        s_lens = np.asarray(seq_lens, dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        # position of token t = t - (start of its chunk in the flat batch) + (its first position)
        req_of_token = np.repeat(np.arange(num_reqs), q_lens)
        starts = query_start_loc[:-1] - (s_lens - q_lens)
        positions = np.arange(query_start_loc[-1]) - starts[req_of_token]
        blocks = tables[req_of_token, positions // block_size].astype(np.int64)
        slots = blocks * block_size + positions % block_size
    int32_parts = (query_start_loc, seq_lens, tables)
    int64_parts = (slots, positions, *extra)
    if device.type == "cpu":  # numpy's arrays as they are: no copies, no casts in torch
        int32 = [torch.from_numpy(np.asarray(a, dtype=np.int32)) for a in int32_parts]
        dev = [torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in int64_parts]
    else:  # every part in one copy (host_copy.to_device_int64), the int32 ones cast there
        sent = to_device_int64(tuple(map(np.asarray, int32_parts + int64_parts)), device)
        int32 = [x.to(torch.int32) for x in sent[:3]]
        dev = sent[3:]
    meta = AttentionMetadata(
        slot_mapping=dev[0],
        query_start_loc=int32[0],
        seq_lens=int32[1],
        block_tables=int32[2],
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max_query_len,
        max_seq_len=max(seq_lens),
        positions=dev[1],
    )
    return meta, dev[2:]


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache and attends (one call per layer).

    Each backend declares what it supports; the runner and the loader ask these, never the
    name, and a model or cache a backend cannot run is refused before the weights load
    (`check_supports`). Every backend takes any mix of prefill chunks and decode rows.
    """

    name: ClassVar[str]
    # Reads a step's shape from device tensors alone (no host lists), so a decode step's
    # forward can be captured as a CUDA graph (model/decode_graphs.py).
    supports_cuda_graphs: ClassVar[bool] = False
    supports_int8_kv: ClassVar[bool] = False  # a QuantizedKVCache (model/kv_cache.py)
    supports_sliding_window: ClassVar[bool] = False  # forward's `window`
    supports_sinks: ClassVar[bool] = False  # forward's `sinks` (gpt-oss)
    # The library whose norm, rotary and activation kernels come with this backend
    # (loading/loader.py's load_weights puts the layers on them): "triton"
    # (conveyor.kernels.fused, on CUDA) or "c" (model/cpu/cpu_kernels.py, in float32; it also
    # runs whole decoder layers and the sampler's argmax). None: torch runs them.
    layer_kernels: ClassVar[str | None] = None

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @classmethod
    def check_supports(cls, kv_cache_dtype: str, windows: bool, sinks: bool = False) -> None:
        """ValueError when this backend cannot run a cache of `kv_cache_dtype` ("auto" or
        "int8"), sliding-window layers where the model has some (`windows`), or attention
        sinks where it has them (`sinks`)."""
        missing = [
            what
            for what, needed, supported in (
                ("an int8 KV cache", kv_cache_dtype == "int8", cls.supports_int8_kv),
                ("sliding-window layers", windows, cls.supports_sliding_window),
                ("attention sinks", sinks, cls.supports_sinks),
            )
            if needed and not supported
        ]
        if missing:
            raise ValueError(
                f"attention_backend {cls.name!r} cannot run {' or '.join(missing)}; choose "
                "another attention_backend."
            )

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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]; stores k/v at meta.slot_mapping.

        window: the layer's sliding window (None: the whole context).
        sinks: [Hq], each query head's sink logit: it joins the softmax's denominator
            (exp(sink - m) with m the max over the scores and the sink) and adds no value;
            None: no sinks. Only a backend that declares supports_sinks gets one."""
