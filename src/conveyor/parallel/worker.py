"""A tensor-parallel worker (rank > 0): load this rank's slices, then run rank 0's steps.

Started as `python -m conveyor.parallel.worker` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (and LOCAL_RANK, its device on this machine) set: by conveyor.parallel.launch on
rank 0's machine, or by hand on another one. Rank 0 sends it the engine's settings and the
checkpoint path once the group has formed. The loop: receive a step (TPGroup.recv_step),
rebuild its attention metadata, run the forward (its all-reduces meet rank 0's) and
contribute to the logits gathers rank 0 makes; no sampling here.

It ends on rank 0's stop message, when rank 0 dies (a collective fails once its sockets
close) or, if rank 0 started it, when its parent process is gone (checked twice a second),
so it never outlives the engine. SIGINT and SIGTERM are ignored, as in the engine process:
a terminal's Ctrl-C or systemd's SIGTERM reach the whole process group, and rank 0 decides
when the engine stops (after the server's graceful drain).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch

from conveyor.model.attention.metadata import build_step_metadata
from conveyor.model.distributed.group import TPGroup, timeout_from_env
from conveyor.model.runner import ModelRunner
from conveyor.model.runner_settings import resolve_device

logger = logging.getLogger(__name__)


@torch.inference_mode()
def serve(runner: ModelRunner) -> None:
    """Run steps until rank 0 sends stop."""
    tp, model, dev = runner.tp, runner.model, runner.device
    assert tp is not None
    while (batch := tp.recv_step()) is not None:
        # The ids and rows go with the metadata, in one copy as on rank 0 (build_step_metadata).
        meta, (ids, prompt_rows, sample_rows) = build_step_metadata(
            batch.query_lens, batch.seq_lens, batch.block_tables, runner.block_size, dev,
            (batch.token_ids, batch.prompt_rows, batch.sample_rows),
        )  # fmt: skip
        hidden = model(ids, meta.positions, runner.kv_caches, meta)
        # The same rows, in the same order, as rank 0's execute: prompt rows, then samples.
        # Rows come in order, each once, so as many as the step's rows is every row (a decode
        # step's samples): the hidden states as they are, as rank 0 takes them, no gather.
        for rows in (prompt_rows, sample_rows):
            if rows.numel():
                model.compute_logits(hidden if rows.numel() == len(hidden) else hidden[rows])


def _exit_with_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="conveyor-tp-parent", daemon=True).start()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "0"))
    logging.basicConfig(
        level=int(os.environ.get("CONVEYOR_TP_LOG_LEVEL", logging.INFO)),
        format=f"%(levelname)s %(asctime)s %(name)s [tp rank {rank}]: %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    if not 0 < rank < size:
        raise SystemExit(
            f"conveyor.parallel.worker runs rank 1 .. WORLD_SIZE - 1; got RANK={rank} "
            f"WORLD_SIZE={size} (set both, with MASTER_ADDR and MASTER_PORT)."
        )
    if "CONVEYOR_TP_PARENT_PID" in os.environ:  # started by rank 0 on this machine
        _exit_with_parent(int(os.environ["CONVEYOR_TP_PARENT_PID"]))
    from conveyor.parallel.launch import threads_per_rank

    try:
        group = TPGroup(rank, size, timeout_from_env())
        config, model_path = group.share()
        device = resolve_device(config.device)
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(size))
        group.open_compute(device)
        runner = ModelRunner(config, model_path, tp=group)
        group.agree_min(runner.num_kv_blocks)  # rank 0 checks that every rank agrees
        serve(runner)
    except Exception:
        logger.exception("Tensor-parallel rank %d failed; it exits.", rank)
        os._exit(1)
    os._exit(0)  # rank 0 asked; nothing here needs tearing down


if __name__ == "__main__":
    main()
