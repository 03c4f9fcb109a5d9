"""CUDA graphs for decode steps: the model's forward captured once per batch size at start-up,
then replayed with persistent input buffers.

A decode step of a small model on a GPU is mostly launch overhead: a Qwen2.5-0.5B-shaped bf16
step is about 15 kernels per layer, each of a few microseconds of GPU work, launched one by one
from Python. A CUDA graph records the whole forward once and replays it with one launch.

What a graph bakes in is the addresses and shapes of its inputs, so every input lives in a
persistent buffer and a step writes into it:

    staging (pinned host, int64)          device (int64)             read by the graph
    [ ids | positions | slots |           one non-blocking copy ->   ids, positions, slots:
      seq_lens | tables (bs x nb) ]                                    views of the device copy
                                                                     seq_lens, block_tables:
                                                                       int32 buffers, cast-copied

A step of `bs` requests replays the smallest captured size P >= bs. Rows bs .. P-1 are padding:
token 0 at position 0 with slot -1 (the KV write skips it) and a context of one key read through
whatever block ids their table rows held before (always valid ids), and their outputs are never
read. The kernel's key splits are fixed at capture from max_model_len (a split with no keys
merges as zero), so one graph serves every context length.

Only pure decode steps qualify (every request brings one new token; no prompt logprobs, no
embeddings), on CUDA with an attention backend that reads the step's shape from device tensors
alone (`supports_cuda_graphs`: Triton's; the torch reference reads host lists). Anything else
runs eagerly.

The staging buffer is reused every step: safe because every step ends with the sampler copying
its tokens to the host, which waits for this step's copy to be done.

Off CUDA (tests, under Triton's interpreter) `capture=False` keeps the buffers and padding and
runs the forward on them eagerly at each "replay": the same inputs a graph would see.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from conveyor.model.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, then every multiple of 8 up to max_num_seqs (and
    max_num_seqs itself), as vLLM's ladder: at most 7 padding rows once past 8."""
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs}
    sizes.update(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class DecodeGraphs:
    """The model's forward for decode batches of the capture sizes, as replayable graphs."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[Any],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        """Allocate the persistent buffers and (capture=True, CUDA only) capture every size.

        Args:
            model: the decoder (`model(input_ids, positions, kv_caches, meta)` -> hidden).
            kv_caches: the engine's KV caches (the graphs write into these very tensors).
            max_num_seqs: the largest batch; the largest captured size.
            max_model_len: the longest context a request may reach (the key splits' basis).
            block_size: tokens per KV block.
            device: where the model runs.
            capture: record CUDA graphs (False: replay runs the forward eagerly, for tests).
        """
        self.model, self.kv_caches = model, kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len, self.block_size, self.device = max_model_len, block_size, device
        n = self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        # Staging: [ids | positions | slots | seq_lens] (n each), then a bs x nb table; the
        # device copy has the same layout. Named views of both:
        length = 4 * n + n * self.max_blocks
        self._host = torch.zeros(length, dtype=torch.int64, pin_memory=device.type == "cuda")
        h = self._host.numpy()
        self._h_ids, self._h_pos, self._h_slots, self._h_lens = h[: 4 * n].reshape(4, n)
        self._h_tables = h[4 * n :]
        self._dev = torch.zeros(length, dtype=torch.int64, device=device)
        self._ids, self._positions, self._slots, self._lens64 = self._dev[: 4 * n].view(4, n)
        self._seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self._tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self._qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        # Every row padding until a step writes it, on the device too: the capture's warm-up
        # forwards then write no K/V (slot -1).
        self._fill_padding(0, n)
        self._dev.copy_(self._host)
        if capture:
            if device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, got {device}.")
            self._capture_all()

    def fits(self, batch: int) -> bool:
        return batch <= self.max_batch

    def _meta(self, size: int) -> AttentionMetadata:
        """The metadata a graph of `size` rows reads: views of the persistent buffers."""
        return AttentionMetadata(
            slot_mapping=self._slots[:size],
            query_start_loc=self._qsl[: size + 1],
            seq_lens=self._seq_lens[:size],
            block_tables=self._tables[:size],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            positions=self._positions[:size],
        )

    def _forward(self, size: int) -> torch.Tensor:
        meta = self._meta(size)
        return self.model(self._ids[:size], meta.positions, self.kv_caches, meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Largest first, all in one memory pool (vLLM's order: the smaller graphs reuse the
        larger ones' memory). Each size runs once eagerly first (Triton compiles its variant)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # warm-up: compiles, and allocates outside the pool
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._outputs[size] = self._forward(size)
                self._graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "CUDA graphs: %d decode batch sizes (1 .. %d) captured in %.1f s.",
            len(self.sizes),
            self.max_batch,
            self.capture_seconds,
        )

    def _fill_padding(self, start: int, stop: int) -> None:
        """Rows start .. stop-1 of the staging buffer as padding (token 0, position 0, slot -1,
        one key)."""
        self._h_ids[start:stop] = 0
        self._h_pos[start:stop] = 0
        self._h_slots[start:stop] = -1
        self._h_lens[start:stop] = 1

    def run(
        self, token_ids: list[int], seq_lens: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """One decode step of len(token_ids) requests (each its last token, at position
        seq_len - 1); returns the final hidden states [bs, hidden] (a view of the graph's
        output: read it before the next run)."""
        bs = len(token_ids)
        size = next(s for s in self.sizes if s >= bs)
        b, nb = self.block_size, max(len(t) for t in block_tables)
        tables = self._h_tables[: bs * nb].reshape(bs, nb)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        pos = np.asarray(seq_lens, dtype=np.int64) - 1
        self._h_ids[:bs] = token_ids
        self._h_pos[:bs] = pos
        self._h_slots[:bs] = tables[np.arange(bs), pos // b] * b + pos % b
        self._h_lens[:bs] = seq_lens
        self._fill_padding(bs, size)
        used = 4 * self.max_batch + bs * nb  # the four rows, then this step's tables
        self._dev[:used].copy_(self._host[:used], non_blocking=True)
        self._seq_lens[:size].copy_(self._lens64[:size])
        self._tables[:bs, :nb].copy_(self._dev[4 * self.max_batch : used].view(bs, nb))
        graph = self._graphs.get(size)
        if graph is None:  # capture=False
            return self._forward(size)[:bs]
        graph.replay()
        return self._outputs[size][:bs]
