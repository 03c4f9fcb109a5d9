"""DataParallelClient: N engine processes (replicas) behind one EngineClient.

    AsyncLLM ──add──► ReplicaRouter: least outstanding tokens ──► EngineProcess i (replica i)
        │   abort ──► the replica that holds the request          own CUDA device, or its
        │   abort_all_at / stop ──► every replica                 own share of the CPU cores
        ▲
        └── emit(outputs, stats, replica=i) / reject / on_dead ◄── each replica's reader thread

Every replica is a whole engine with the same EngineConfig (data_parallel_size 1 each): its
own weights, scheduler, KV cache and prefix cache. Placement: on CUDA replica i sees only the
i-th visible GPU (CUDA_VISIBLE_DEVICES in its environment); on CPU the cores this process may
use are split into N contiguous groups, one per replica (sched_setaffinity, and as many torch
threads as it has cores). One replica that dies makes the whole client dead (`on_dead`), as a
single engine process does: the server exits non-zero for its supervisor.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from conveyor.engine.config import EngineConfig
from conveyor.engine.outputs import RequestOutput
from conveyor.entrypoints.engine_client import StepStats
from conveyor.entrypoints.engine_process import EngineInfo, EngineProcess
from conveyor.entrypoints.replica_router import ReplicaRouter
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one replica runs: extra environment for its process, and its CPU cores (None:
    not pinned)."""

    env: dict[str, str]
    cpu_cores: tuple[int, ...] | None


def replica_placements(num_replicas: int, device: str) -> list[Placement]:
    """One placement per replica for `device` ("auto", "cpu" or "cuda").

    Raises:
        ValueError: fewer CUDA devices, or CPU cores, than replicas.
    """
    import torch

    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [d.strip() for d in visible.split(",")] if visible else None
        count = len(ids) if ids is not None else torch.cuda.device_count()
        if count < num_replicas:
            raise ValueError(
                f"data_parallel_size={num_replicas} puts each replica on its own GPU, but "
                f"{count} CUDA device(s) are visible; lower --data-parallel-size."
            )
        ids = ids or [str(i) for i in range(count)]
        return [Placement({"CUDA_VISIBLE_DEVICES": ids[i]}, None) for i in range(num_replicas)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < num_replicas:
        raise ValueError(
            f"data_parallel_size={num_replicas} gives each replica its own CPU cores, but this "
            f"process may use {len(cores)} core(s); lower --data-parallel-size."
        )
    per, extra = divmod(len(cores), num_replicas)
    placements, start = [], 0
    for i in range(num_replicas):
        size = per + (i < extra)
        placements.append(Placement({}, tuple(cores[start : start + size])))
        start += size
    return placements


class DataParallelClient:
    """Start `config.data_parallel_size` engine processes; route each request to one.

    Args:
        config: the engine's settings; each replica gets a copy with data_parallel_size 1
            (num_kv_blocks and max_model_len are filled in with what the replicas resolved;
            they must agree).
        emit: `emit(outputs, stats, replica)` after every step of replica `replica`.
        reject, on_dead: as for EngineProcess.
        wake: `wake(replica)` when a request goes to a replica that held none (its silence
            counts from then on, for the heartbeat); called from `add`'s thread.
    Raises:
        ValueError: a bad placement, or the engine rejected the config (a replica's error).
        EngineProcessError: a replica died or timed out while starting.
    """

    def __init__(
        self,
        config: EngineConfig,
        emit: Callable[..., None],
        reject: Callable[[str, ValueError], None],
        on_dead: Callable[[BaseException], None],
        startup_timeout_s: float = 900.0,
        wake: Callable[[int], None] | None = None,
    ) -> None:
        num = config.data_parallel_size
        placements = replica_placements(num, config.device)
        self._reject, self._on_dead, self._wake = reject, on_dead, wake
        self._dead_once = threading.Lock()
        self._dead = False
        # All at once (each loads its own weights); each gets its own copy of the config.
        pool = ThreadPoolExecutor(num, thread_name_prefix="conveyor-replica-start")
        futures = [
            pool.submit(
                EngineProcess,
                dataclasses.replace(config, data_parallel_size=1),
                emit=self._emitter(i, emit),
                reject=self._rejecter,
                on_dead=self._die,
                startup_timeout_s=startup_timeout_s,
                env=placement.env,
                cpu_cores=placement.cpu_cores,
            )
            for i, placement in enumerate(placements)
        ]
        pool.shutdown(wait=True)
        self.replicas: list[EngineProcess] = [f.result() for f in futures if not f.exception()]
        failed = next((f.exception() for f in futures if f.exception()), None)
        if failed is not None:
            self.stop(timeout_s=5.0)
            raise failed
        self.info: EngineInfo = self.replicas[0].info
        resolved = {(r.info.num_kv_blocks, r.info.limits.max_model_len) for r in self.replicas}
        if len(resolved) != 1:  # the router and the pooled KV usage assume equal replicas
            self.stop(timeout_s=5.0)
            raise ValueError(
                f"the replicas resolved different KV cache sizes or contexts {sorted(resolved)}; "
                "set --num-kv-blocks and --max-model-len so that they agree."
            )
        config.num_kv_blocks = self.info.num_kv_blocks
        config.max_model_len = self.info.limits.max_model_len
        for i, (replica, placement) in enumerate(zip(self.replicas, placements, strict=True)):
            where = placement.env or f"CPU cores {list(placement.cpu_cores or ())}"
            logger.info(
                "Data-parallel replica %d: engine process pid %d on %s", i, replica.pid, where
            )
        self.router = ReplicaRouter(num, self.info.limits.max_model_len)

    # ---------------------------------------------------------------- callbacks
    def _emitter(self, index: int, emit: Callable[..., None]) -> Callable[..., None]:
        def on_step(outputs: list[RequestOutput], stats: StepStats) -> None:
            for out in outputs:
                new = sum(len(c.token_ids) for c in out.outputs)
                self.router.progress(out.request_id, new, out.finished)
            emit(outputs, stats, index)

        return on_step

    def _rejecter(self, request_id: str, exc: ValueError) -> None:
        self.router.release(request_id)
        self._reject(request_id, exc)

    def _die(self, exc: BaseException) -> None:
        with self._dead_once:  # the first death is the one to report
            if self._dead:
                return
            self._dead = True
        self._on_dead(exc)

    # ---------------------------------------------------------------- EngineClient
    @property
    def pids(self) -> list[int]:
        return [replica.pid for replica in self.replicas]

    @property
    def started(self) -> bool:
        return all(replica.started for replica in self.replicas)

    @property
    def alive(self) -> bool:
        return all(replica.alive for replica in self.replicas)

    @property
    def num_waiting_seqs(self) -> int:
        return sum(replica.num_waiting_seqs for replica in self.replicas)

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def add(
        self,
        request_id: str,
        prompt: str | list[int],
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        index = self.router.route(request_id, len(prompt_ids), params.max_tokens, params.n)
        if self._wake is not None and self.router.num_in_flight(index) == 1:
            self._wake(index)
        self.replicas[index].add(request_id, prompt, prompt_ids, params, arrival_time)

    def abort(self, request_id: str) -> None:
        index = self.router.replica_of(request_id)
        if index is not None:  # finished already: nothing to abort
            self.replicas[index].abort(request_id)

    def abort_all_at(self, when: float, reason: str) -> None:
        for replica in self.replicas:
            replica.abort_all_at(when, reason)

    def stop(self, final_reason: str | None = None, timeout_s: float | None = None) -> None:
        """Blocking: stop every replica at once (so the whole takes one replica's time)."""
        threads = [
            threading.Thread(target=replica.stop, args=(final_reason, timeout_s), daemon=True)
            for replica in self.replicas
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
