"""Rank 0's side of tensor parallelism: start the workers, join the group, watch, stop.

    create_runner(config)
      tensor_parallel_size 1: ModelRunner(config), and nothing else (no process, no
                              torch.distributed)
      tensor_parallel_size N: the checks (config.json shapes, GGUF, the rendezvous port)
                              -> N - 1 worker processes (conveyor.parallel.worker)
                              -> TPGroup as rank 0 -> ModelRunner(tp=group)
                              -> every rank confirms the same KV block count

Rendezvous (env://): MASTER_ADDR (default 127.0.0.1) and MASTER_PORT (default: a free port
on this machine; one given that cannot be bound is a ValueError). Workers are fresh
interpreters (`python -m conveyor.parallel.worker`), not multiprocessing's spawn, which
re-imports the caller's __main__; rank 0 sends them the engine's settings once they joined.
With CONVEYOR_TP_LOCAL_SIZE=L only ranks 1 .. L-1 start here; the others are started by hand
on other machines (the same command, with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
LOCAL_RANK set) and must see the checkpoint at the same path. On CPU each rank runs
max(1, cores // N) torch threads.

A watchdog thread per local worker waits for its exit: an exit the engine did not ask for sets
`group.failure` and calls `group.on_failure` (EngineThread wakes and ends the engine; the
server then exits non-zero); the next step raises TensorParallelError. Workers leave on a
stop message, or by themselves when this process is gone (worker.py), so none is orphaned.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import socket
import subprocess
import sys
import threading

import torch
import torch.distributed as dist

from conveyor.config import EngineConfig
from conveyor.model.distributed.group import TensorParallelError, TPGroup, timeout_from_env
from conveyor.model.loading.demo import demo_model_path
from conveyor.model.runner import ModelRunner
from conveyor.model.runner_settings import resolve_device

logger = logging.getLogger(__name__)


def threads_per_rank(size: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // size)


def create_runner(config: EngineConfig) -> ModelRunner:
    """The engine's ModelRunner: in this process alone, or rank 0 of a started group."""
    size = config.tensor_parallel_size
    if size == 1:
        return ModelRunner(config)
    model_path = str(config.model or demo_model_path())
    _check_model(model_path, size)
    device = resolve_device(config.device)
    addr, port = _rendezvous()
    local = _local_size(size)
    if dist.is_initialized():
        # An LLM dropped without shutdown() and caught in a reference cycle waits for the
        # cyclic GC to run its finalizer (which leaves the group): run it now.
        gc.collect()
    if dist.is_initialized():
        raise ValueError(
            "a tensor-parallel engine (or another torch.distributed group) is already running "
            "in this process, and a process holds one group: call that LLM's shutdown() (or "
            "use `with LLM(...) as llm:`) first."
        )
    env = {**os.environ, "MASTER_ADDR": addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(size)}
    env["CONVEYOR_TP_LOG_LEVEL"] = str(logging.getLogger("conveyor").getEffectiveLevel())
    env["CONVEYOR_TP_PARENT_PID"] = str(os.getpid())
    procs = []
    for rank in range(1, local):
        proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor.parallel.worker"],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        logger.info("Tensor-parallel worker rank %d started (pid %d)", rank, proc.pid)
        procs.append(proc)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(threads_per_rank(size))
    try:
        group = TPGroup(0, size, timeout_from_env(), addr, port)
        group.share((config, model_path))
        group.open_compute(device)
    except Exception as exc:
        _kill(procs)
        torch.set_num_threads(threads)
        raise ValueError(
            f"the {size} tensor-parallel ranks could not join at {addr}:{port} "
            f"(MASTER_ADDR/MASTER_PORT): {exc}"
        ) from exc
    workers = Workers(procs, group, threads)
    try:
        runner = ModelRunner(config, model_path, tp=group)
        if group.agree_min(runner.num_kv_blocks) != runner.num_kv_blocks:
            raise RuntimeError("the tensor-parallel ranks sized different KV caches.")
    except Exception as exc:
        failure = group.failure
        workers.stop(graceful=False)
        if failure is not None:
            raise RuntimeError(f"{failure} (while starting; its error is in the log)") from exc
        raise
    runner.tp_workers = workers
    return runner


def shutdown_runner(runner: ModelRunner) -> None:
    """Stop a tensor-parallel runner's workers and leave the group (no-op for size 1)."""
    workers = getattr(runner, "tp_workers", None)
    if workers is not None:
        workers.stop()


def _check_model(model_path: str, size: int) -> None:
    """Shapes that cannot be split, or a GGUF file, are refused before any process starts."""
    from conveyor.model.distributed.sharding import check_tensor_parallel
    from conveyor.model.loading.checkpoint import find_gguf_file
    from conveyor.model.loading.hf_config import model_config, read_hf_config

    if find_gguf_file(model_path) is not None:
        raise ValueError(
            "tensor_parallel_size > 1 is not supported for GGUF models; use an HF safetensors "
            "checkpoint, or tensor_parallel_size 1."
        )
    check_tensor_parallel(model_config(read_hf_config(model_path)), size)


def _local_size(size: int) -> int:
    """How many ranks run here: CONVEYOR_TP_LOCAL_SIZE (default all); ranks from it on are
    started elsewhere with `python -m conveyor.parallel.worker`."""
    raw = os.environ.get("CONVEYOR_TP_LOCAL_SIZE")
    if raw is None:
        return size
    if not raw.isdigit() or not 1 <= int(raw) <= size:
        raise ValueError(
            f"CONVEYOR_TP_LOCAL_SIZE must be a number of ranks in 1..{size} (the ranks this "
            f"machine runs, rank 0 included), got {raw!r}."
        )
    return int(raw)


def _rendezvous() -> tuple[str, int]:
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    raw = os.environ.get("MASTER_PORT")
    if raw is None:
        with socket.socket() as s:
            s.bind((addr, 0))
            return addr, s.getsockname()[1]
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"MASTER_PORT must be a port number, got {raw!r}.") from None
    try:
        with socket.socket() as s:
            s.bind((addr, port))
    except OSError as exc:
        raise ValueError(
            f"MASTER_PORT {port} on MASTER_ADDR {addr} cannot be used for the tensor-parallel "
            f"rendezvous ({exc.strerror}): free it, pick another port, or unset MASTER_PORT "
            "to have a free one chosen."
        ) from None
    return addr, port


class Workers:
    """The worker processes of one group, each watched by a thread."""

    def __init__(self, procs: list[subprocess.Popen], group: TPGroup, threads: int) -> None:
        self.procs, self.group, self._threads = procs, group, threads
        self._stopping = False
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"conveyor-tp-watch-{rank}", daemon=True
            ).start()
        atexit.register(self.stop)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping:
            return
        error = TensorParallelError(
            f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}; "
            "the engine cannot go on without it."
        )
        logger.error("%s", error)
        if self.group.failure is None:
            self.group.failure = error
        for callback in list(self.group.on_failure):
            callback()

    def stop(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        """Ask the workers to leave (graceful, if none failed), then kill any still there."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.stop)
        clean = graceful and self.group.failure is None
        if clean:
            sender = threading.Thread(target=self._send_stop, daemon=True)
            sender.start()
            sender.join(timeout_s)
            clean = not sender.is_alive()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_s if clean else 0.1)
        _kill(self.procs)
        # Leave the group (so that another engine may start one), bounded: after a failure
        # it may wait on peers that are gone.
        leaver = threading.Thread(target=self.group.destroy, daemon=True)
        leaver.start()
        leaver.join(timeout_s if clean else 2.0)
        torch.set_num_threads(self._threads)

    def _send_stop(self) -> None:
        with contextlib.suppress(Exception):
            self.group.send_stop()


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
