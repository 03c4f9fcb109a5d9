"""Starting the engine an AsyncLLM drives: in a thread of this process, in a child process, or
as N data-parallel replica processes, and what the server learns from it at start.

    engine_process=False          LLMEngine here, built and stepped by an EngineThread
    engine_process=True           EngineProcess (a child process; engine_process.py)
      and data_parallel_size N>1  DataParallelClient (N child processes; data_parallel.py)

With a child process the tokenizer loads here while the child loads the weights (building one
from a GGUF file's vocabulary takes seconds); a failed start is reported at once.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from conveyor.config import EngineConfig
from conveyor.core.limits import PromptLimits
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.tokenizer import Tokenizer
from conveyor.entrypoints.data_parallel import DataParallelClient
from conveyor.entrypoints.engine_client import EngineClient
from conveyor.entrypoints.engine_process import EngineProcess
from conveyor.entrypoints.engine_thread import EngineThread
from conveyor.model.loading.pooling_config import PoolingConfig


@dataclass(slots=True)
class StartedEngine:
    core: EngineClient  # what AsyncLLM adds to, aborts and stops
    engine: LLMEngine | None  # the in-process engine, None when it runs in child processes
    model_path: str
    limits: PromptLimits
    tokenizer: Tokenizer
    pooling: PoolingConfig | None = None  # how embedding requests pool


def start_engine(
    config: EngineConfig,
    engine_process: bool,
    callbacks: dict[str, Callable[..., Any]],
    wake: Callable[[int], None],
    replica_options: dict[str, Any] | None = None,
    heartbeat_timeout_s: float | None = None,
) -> StartedEngine:
    """Build the engine client for `config` (its thread or processes start later, with
    `core.start()`).

    Args:
        callbacks: "emit", "reject" and "on_dead", as EngineClient implementations take them.
        wake: called with a replica's index when a request reaches an idle replica.
        replica_options: DataParallelClient's degraded-mode arguments (on_replica_dead,
            on_replica_restarted, max_replica_restarts); used with data_parallel_size > 1.
        heartbeat_timeout_s: an engine process silent that long (not even its beat) is
            killed and dead (None: never); not used with an engine thread.
    """
    if not engine_process:
        core = EngineThread.build(lambda: LLMEngine(config), **callbacks)  # (see build)
        engine = core.engine
        return StartedEngine(
            core, engine, engine.model_path, engine.limits, engine.tokenizer, engine.pooling
        )
    folder = config.tokenizer or config.model
    pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    try:
        pending = pool.submit(Tokenizer.from_pretrained, folder) if folder else None
        process: EngineClient
        if config.data_parallel_size > 1:
            process = DataParallelClient(
                config, wake=wake, heartbeat_timeout_s=heartbeat_timeout_s, **callbacks,
                **(replica_options or {}),
            )  # fmt: skip
        else:
            process = EngineProcess(config, heartbeat_timeout_s=heartbeat_timeout_s, **callbacks)
        info = process.info  # type: ignore[attr-defined]
        tokenizer = pending.result() if pending else Tokenizer.from_pretrained(info.model_path)
        return StartedEngine(process, None, info.model_path, info.limits, tokenizer, info.pooling)
    finally:
        pool.shutdown(wait=False)
