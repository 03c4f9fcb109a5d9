"""DataParallelClient: N engine processes (replicas) behind one EngineClient.

    AsyncLLM ──add──► ReplicaRouter: least outstanding tokens ──► EngineProcess i (replica i)
        │   abort ──► the replica that holds the request          own CUDA device, or its
        │   abort_all_at / stop ──► every replica                 own share of the CPU cores
        ▲                                                         (replica_placement.py)
        └── emit(outputs, stats, replica=i) / reject / on_replica_dead ◄── each replica's
                                                                           reader thread

Every replica is a whole engine with the same EngineConfig (data_parallel_size 1 each): its
own weights, scheduler, KV cache and prefix cache.

Degraded mode: a replica whose engine dies (its process is killed or crashes, or its engine
fails) costs only the requests it held:

    replica i dies ──► router.take_down(i): no new request goes to it
                   ──► on_replica_dead(i, its request ids, error): those requests end with
                       an error; the other replicas' requests go on
                   ──► a thread reaps the old process and starts a new one with the same
                       placement and resolved config ──► router.bring_up(i),
                       on_replica_restarted(i)

Each replica may be restarted `max_replica_restarts` times (a replacement that fails to start
counts as another death); a death past that makes the whole client dead (`on_dead`), as a
single engine process's death does: the server exits non-zero for its supervisor.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from conveyor.config import EngineConfig
from conveyor.engine.outputs import RequestOutput
from conveyor.entrypoints.engine_client import StepStats
from conveyor.entrypoints.engine_process import EngineInfo, EngineProcess
from conveyor.entrypoints.replica_placement import replica_placements
from conveyor.entrypoints.replica_router import ReplicaRouter
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class DataParallelClient:
    """Start `config.data_parallel_size` engine processes; route each request to one.

    Args:
        config: the engine's settings; each replica gets a copy with data_parallel_size 1
            (num_kv_blocks and max_model_len are filled in with what the replicas resolved;
            they must agree).
        emit: `emit(outputs, stats, replica)` after every step of replica `replica`.
        reject, on_dead: as for EngineProcess (on_dead: a replica died past its restarts).
        wake: `wake(replica)` when a request goes to a replica that held none (its silence
            counts from then on, for the heartbeat); called from `add`'s thread.
        on_replica_dead: `on_replica_dead(replica, request_ids, error)` when a replica died
            and is being restarted: those requests (routed to it) will never finish.
        on_replica_restarted: `on_replica_restarted(replica)` once its replacement serves.
        max_replica_restarts: how many times each replica may be restarted.
        heartbeat_timeout_s: each replica's (and each replacement's) EngineProcess
            heartbeat_timeout_s: a replica silent that long is killed, then restarted.
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
        on_replica_dead: Callable[[int, list[str], BaseException], None] | None = None,
        on_replica_restarted: Callable[[int], None] | None = None,
        max_replica_restarts: int = 0,
        heartbeat_timeout_s: float | None = None,
    ) -> None:
        num = config.data_parallel_size
        self._placements = replica_placements(num, config.device)
        self._emit, self._reject, self._on_dead, self._wake = emit, reject, on_dead, wake
        self._on_replica_dead = on_replica_dead or (lambda *_: None)
        self._on_replica_restarted = on_replica_restarted or (lambda _: None)
        self._startup_timeout_s = startup_timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self.max_replica_restarts = max_replica_restarts
        self.restarts = [0] * num  # restarts begun, per replica
        # Guards the slots, generations and flags below: deaths arrive from reader threads.
        self._lock = threading.Lock()
        self._generation = [0] * num  # a death of an older generation is a stale report
        self._dead = self._stopping = self._started = False
        self._abort_all: tuple[float, str] | None = None  # for replacements, too
        self._config = dataclasses.replace(config, data_parallel_size=1)
        self.replicas: list[EngineProcess | None] = [None] * num
        # All at once (each loads its own weights); each gets its own copy of the config.
        pool = ThreadPoolExecutor(num, thread_name_prefix="conveyor-replica-start")
        futures = [pool.submit(self._spawn, i) for i in range(num)]
        pool.shutdown(wait=True)
        self.replicas = [f.result() if not f.exception() else None for f in futures]
        failed = next((f.exception() for f in futures if f.exception()), None)
        if failed is not None:
            self.stop(timeout_s=5.0)
            raise failed
        started = [r for r in self.replicas if r is not None]
        self.info: EngineInfo = started[0].info
        resolved = {(r.info.num_kv_blocks, r.info.limits.max_model_len) for r in started}
        if len(resolved) != 1:  # the router and the pooled KV usage assume equal replicas
            self.stop(timeout_s=5.0)
            raise ValueError(
                f"the replicas resolved different KV cache sizes or contexts {sorted(resolved)}; "
                "set --num-kv-blocks and --max-model-len so that they agree."
            )
        # A replacement starts from what the first ones resolved, so that it resolves the same.
        self._config.num_kv_blocks = config.num_kv_blocks = self.info.num_kv_blocks
        self._config.max_model_len = config.max_model_len = self.info.limits.max_model_len
        self.router = ReplicaRouter(num, self.info.limits.max_model_len)

    # ---------------------------------------------------------------- replicas' lives
    def _spawn(self, index: int) -> EngineProcess:
        """Start replica `index`'s engine process (blocking until its engine is built)."""
        placement, generation = self._placements[index], self._generation[index]
        replica = EngineProcess(
            dataclasses.replace(self._config),
            emit=self._emitter(index),
            reject=self._rejecter,
            on_dead=lambda exc: self._replica_died(index, generation, exc),
            startup_timeout_s=self._startup_timeout_s,
            env=placement.env,
            cpu_cores=placement.cpu_cores,
            heartbeat_timeout_s=self._heartbeat_timeout_s,
        )
        where = placement.env or f"CPU cores {list(placement.cpu_cores or ())}"
        again = f" (restart {self.restarts[index]})" if self.restarts[index] else ""
        logger.info(
            "Data-parallel replica %d: engine process pid %d on %s%s",
            index, replica.pid, where, again,
        )  # fmt: skip
        return replica

    def _replica_died(self, index: int, generation: int, exc: BaseException) -> None:
        """Replica `index` (of `generation`) died: fail its requests, restart it or give up.
        Called from its reader thread, or from a restart that failed."""
        with self._lock:
            if generation != self._generation[index] or self._dead or self._stopping:
                return  # reported twice (a failed engine, then its pipe closing), or expected
            self._generation[index] += 1
            old, self.replicas[index] = self.replicas[index], None
            give_up = self.restarts[index] >= self.max_replica_restarts
            if give_up:
                self._dead = True
            else:
                self.restarts[index] += 1
        request_ids = self.router.take_down(index)
        if give_up:
            logger.error(
                "Data-parallel replica %d died after %d restart(s) (--max-replica-restarts "
                "%d): %s",
                index, self.restarts[index], self.max_replica_restarts, exc,
            )  # fmt: skip
            if old is not None:  # reaped in another thread: this may be its reader thread
                threading.Thread(target=old.stop, args=(None, 2.0), daemon=True).start()
            self._on_dead(exc)
            return
        logger.error(
            "Data-parallel replica %d died (%s); ending its %d request(s) with an error and "
            "restarting it (restart %d of at most %d).",
            index, exc, len(request_ids), self.restarts[index], self.max_replica_restarts,
        )  # fmt: skip
        self._on_replica_dead(index, request_ids, exc)
        threading.Thread(
            target=self._restart, args=(index, old), name=f"conveyor-replica-{index}-restart",
            daemon=True,
        ).start()  # fmt: skip

    def _restart(self, index: int, old: EngineProcess | None) -> None:
        """Reap the dead replica's process, start its replacement and route to it again."""
        if old is not None:  # killed already, or alive with a failed engine: end it
            old.stop(None, timeout_s=2.0)
        generation = self._generation[index]
        try:
            replica = self._spawn(index)
        except Exception as exc:  # counts as another death (restart again, or give up)
            self._replica_died(index, generation, exc)
            return
        with self._lock:
            current = generation == self._generation[index] and not self._stopping
            if current:
                self.replicas[index] = replica
        if not current:  # the client stopped (or died) meanwhile
            replica.stop(None, timeout_s=2.0)
            return
        if self._abort_all is not None:
            replica.abort_all_at(*self._abort_all)
        if self._started:
            replica.start()
        self.router.bring_up(index)
        logger.info("Data-parallel replica %d serves again.", index)
        self._on_replica_restarted(index)

    # ---------------------------------------------------------------- callbacks
    def _emitter(self, index: int) -> Callable[[list[RequestOutput], StepStats], None]:
        def on_step(outputs: list[RequestOutput], stats: StepStats) -> None:
            for out in outputs:
                new = sum(len(c.token_ids) for c in out.outputs)
                self.router.progress(out.request_id, new, out.finished)
            self._emit(outputs, stats, index)

        return on_step

    def _rejecter(self, request_id: str, exc: ValueError) -> None:
        self.router.release(request_id)
        self._reject(request_id, exc)

    # ---------------------------------------------------------------- EngineClient
    def _live(self) -> list[EngineProcess]:
        return [replica for replica in self.replicas if replica is not None]

    @property
    def pids(self) -> list[int | None]:
        """Each replica's engine process id (None while it is restarting)."""
        return [None if replica is None else replica.pid for replica in self.replicas]

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def num_serving(self) -> int:
        """Replicas that get new requests (the others are restarting)."""
        return 0 if self._dead else self.router.num_serving

    @property
    def started(self) -> bool:
        return self._started

    @property
    def alive(self) -> bool:
        """No replica died past its restarts (some may be restarting)."""
        return not self._dead

    @property
    def num_waiting_seqs(self) -> int:
        return sum(replica.num_waiting_seqs for replica in self._live())

    def start(self) -> None:
        self._started = True
        for replica in self._live():
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
        replica = self.replicas[index]
        # None: it died since route() picked it; its death hands this request back as failed.
        if replica is not None:
            replica.add(request_id, prompt, prompt_ids, params, arrival_time)

    def abort(self, request_id: str) -> None:
        index = self.router.replica_of(request_id)
        replica = None if index is None else self.replicas[index]
        if replica is not None:  # finished already, or its replica died: nothing to abort
            replica.abort(request_id)

    def abort_all_at(self, when: float, reason: str) -> None:
        self._abort_all = (when, reason)
        for replica in self._live():
            replica.abort_all_at(when, reason)

    def stop(self, final_reason: str | None = None, timeout_s: float | None = None) -> None:
        """Blocking: stop every replica at once (so the whole takes one replica's time); a
        replacement still starting is stopped once it has."""
        with self._lock:
            self._stopping = True
        threads = [
            threading.Thread(target=replica.stop, args=(final_reason, timeout_s), daemon=True)
            for replica in self._live()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
