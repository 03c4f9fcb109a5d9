"""TPGroup: one rank's handle on the tensor-parallel group (torch.distributed, env://).

Two process groups span the same ranks:

    control   the default group: gloo on the host. Rank 0's settings for the workers, its
              step messages (rank 0's sends bounded by `timeout_s`; a worker waits for the
              next one as long as the engine is idle), the start-up agreement. The
              rendezvous is bounded by max(`timeout_s`, 120 s).
    compute   gloo on CPU, NCCL on CUDA; every op bounded by `timeout_s`
              (CONVEYOR_TP_TIMEOUT_S, default 60 s): the two all-reduces per layer, the
              embedding's all-reduce, the gather of vocab-parallel logits to rank 0.

A step message is two broadcasts from rank 0 of int64 host tensors: a header [kind, T, B,
max_blocks, prompt rows, sample rows] and, for a step, one payload: the T token ids, the B
query and context lengths, the [B, max_blocks] block tables (0-padded), the rows whose logits
feed prompt logprobs, and the rows sampled. Workers rebuild the attention metadata from it.
A peer that dies closes its sockets, so the collective it leaves waiting fails at once; one
that hangs makes the next compute op fail after `timeout_s`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 120.0
_STEP, _STOP = 1, 2
_HEADER = 6


class TensorParallelError(RuntimeError):
    """A rank died, hung or failed: the engine cannot go on (`fatal`: EngineThread ends)."""

    fatal = True


@dataclass(slots=True)
class StepBatch:
    """What a worker needs to run rank 0's step."""

    token_ids: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    prompt_rows: list[int]
    sample_rows: list[int]


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ValueError(
            f"{name} is not set: a tensor-parallel worker needs RANK, WORLD_SIZE, MASTER_ADDR "
            "and MASTER_PORT (rank 0's rendezvous) in its environment."
        )
    return value


def timeout_from_env() -> float:
    raw = os.environ.get("CONVEYOR_TP_TIMEOUT_S")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"CONVEYOR_TP_TIMEOUT_S must be a number of seconds > 0, got {raw!r}.")
    return value


class TPGroup:
    """Join the group as `rank` of `size`: blocks until every rank has joined, at most
    max(`timeout_s`, JOIN_TIMEOUT_S). Then rank 0 `share`s the engine's settings and every
    rank calls `open_compute`.

    Args:
        addr, port: rank 0's rendezvous; None: MASTER_ADDR / MASTER_PORT (env://), as the
            workers get them.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        timeout_s: float,
        addr: str | None = None,
        port: int | None = None,
    ) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        # The device index on this machine (torchrun's LOCAL_RANK; all ranks local by default).
        self.local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if addr is None or port is None:
            addr, port = _env("MASTER_ADDR"), int(_env("MASTER_PORT"))
        # The store bounds the rendezvous (at least JOIN_TIMEOUT_S: a worker first imports
        # torch); the control group itself never times out.
        join = timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S))
        store = dist.TCPStore(addr, port, size, is_master=rank == 0, timeout=join)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=size, timeout=timedelta(days=365)
        )
        self.control = dist.group.WORLD
        self.compute: dist.ProcessGroup | None = None
        self.failure: TensorParallelError | None = None  # set by rank 0's watchdog
        self.on_failure: list[Callable[[], None]] = []  # called by the watchdog then
        self.comm_seconds = 0.0  # time in compute collectives (benchmarks read it)
        self.num_collectives = 0
        self.timed = False  # synchronize and time each collective (benchmarks only)

    def share(self, value: object = None) -> object:
        """Rank 0's `value` on every rank (the others pass nothing)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def open_compute(self, device: torch.device) -> None:
        """The compute group on `device` (NCCL on CUDA, rank r's `cuda:LOCAL_RANK`)."""
        if device.type == "cuda":
            torch.cuda.set_device(self.local_rank)
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.compute = dist.new_group(backend=backend, timeout=timedelta(seconds=self.timeout_s))

    def guard(self, step: Callable[..., object], *args: object) -> object:
        """Run `step`; any failure in it becomes a TensorParallelError (the ranks are out of
        step after it: the engine must end), as does a failure the watchdog saw."""
        if self.failure is not None:
            raise self.failure
        try:
            return step(*args)
        except Exception as exc:
            reason = self.failure or exc
            raise TensorParallelError(f"A tensor-parallel step failed: {reason}") from exc

    # ------------------------------------------------------------------ compute group
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.timed:
            return self._timed(lambda t: dist.all_reduce(t, group=self.compute), x)
        dist.all_reduce(x, group=self.compute)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Rank 0: every rank's [N, V/size] logits side by side, [N, vocab_size] (padding
        dropped); the other ranks: None."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        if self.timed:
            self._timed(lambda t: dist.gather(t, parts, dst=0, group=self.compute), local)
        else:
            dist.gather(local, parts, dst=0, group=self.compute)
        if parts is None:
            return None
        return torch.cat(parts, dim=1)[:, :vocab_size]

    def _timed(self, op: Callable[[torch.Tensor], object], x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        op(x)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.comm_seconds += time.perf_counter() - start
        self.num_collectives += 1
        return x

    # ------------------------------------------------------------------ control group
    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (all ranks call it)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def send_step(self, batch: StepBatch) -> None:
        """Rank 0: send one step's batch to the other ranks."""
        width = max(len(t) for t in batch.block_tables)
        tables = np.zeros((len(batch.block_tables), width), dtype=np.int64)
        for i, table in enumerate(batch.block_tables):
            tables[i, : len(table)] = table
        header = [_STEP, len(batch.token_ids), len(batch.query_lens), width]
        header += [len(batch.prompt_rows), len(batch.sample_rows)]
        payload = np.concatenate(
            [
                np.asarray(batch.token_ids, dtype=np.int64),
                np.asarray(batch.query_lens, dtype=np.int64),
                np.asarray(batch.seq_lens, dtype=np.int64),
                tables.ravel(),
                np.asarray(batch.prompt_rows, dtype=np.int64),
                np.asarray(batch.sample_rows, dtype=np.int64),
            ]
        )
        self._send(torch.tensor(header, dtype=torch.int64))
        self._send(torch.from_numpy(payload))

    def _send(self, t: torch.Tensor) -> None:
        """Broadcast from rank 0 on the control group, bounded by `timeout_s` (a hung
        worker does not take the message)."""
        work = dist.broadcast(t, 0, group=self.control, async_op=True)
        work.wait(timeout=timedelta(seconds=self.timeout_s))

    def recv_step(self) -> StepBatch | None:
        """A worker: the next step's batch, or None when rank 0 says stop."""
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.control)
        kind, t, b, width, num_prompt, num_sample = header.tolist()
        if kind == _STOP:
            return None
        payload = torch.empty(t + 2 * b + b * width + num_prompt + num_sample, dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.control)
        values = payload.tolist()
        ends = np.cumsum([t, b, b, b * width, num_prompt])
        token_ids, query_lens, seq_lens, flat, prompt_rows, sample_rows = (
            values[s:e] for s, e in zip([0, *ends], [*ends, len(values)], strict=True)
        )
        tables = [flat[i * width : (i + 1) * width] for i in range(b)]
        return StepBatch(token_ids, query_lens, seq_lens, tables, prompt_rows, sample_rows)

    def send_stop(self) -> None:
        """Rank 0: tell the workers to leave their loop."""
        header = torch.tensor([_STOP, 0, 0, 0, 0, 0], dtype=torch.int64)
        dist.broadcast(header, 0, group=self.control)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
