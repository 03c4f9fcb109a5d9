"""A tensor-parallel worker (rank > 0): load this rank's slices, then run rank 0's steps.

Started by conveyor.parallel.launch as `python -c ...` with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set and (engine config, model path, log level) in argv. The loop: receive a
step (TPGroup.recv_step), rebuild its attention metadata, run the forward (its all-reduces
meet rank 0's) and contribute to the logits gathers rank 0 makes; no sampling here.

It ends on rank 0's stop message; when rank 0 dies (a collective fails once its sockets
close) or when its parent process is gone (checked twice a second), so it never outlives the
engine. SIGINT is ignored: a terminal's Ctrl-C reaches the whole process group, and rank 0
decides when the engine stops.
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import signal
import threading
import time

import torch

from conveyor.model.attention import build_attention_metadata
from conveyor.model.runner import ModelRunner, resolve_device
from conveyor.parallel.group import TPGroup, timeout_from_env

logger = logging.getLogger(__name__)


@torch.inference_mode()
def serve(runner: ModelRunner) -> None:
    """Run steps until rank 0 sends stop."""
    tp, model, dev = runner.tp, runner.model, runner.device
    assert tp is not None
    while (batch := tp.recv_step()) is not None:
        meta = build_attention_metadata(
            batch.query_lens, batch.seq_lens, batch.block_tables, runner.block_size, dev
        )
        ids = torch.tensor(batch.token_ids, dtype=torch.long, device=dev)
        hidden = model(ids, meta.positions, runner.kv_caches, meta)
        # The same gathers, in the same order, as rank 0's execute: prompt rows, then samples.
        for rows in (batch.prompt_rows, batch.sample_rows):
            if rows:
                model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)])


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="conveyor-tp-parent", daemon=True).start()


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config, model_path, log_level = pickle.loads(base64.b64decode(argv[0]))
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(
        level=log_level,
        format=f"%(levelname)s %(asctime)s %(name)s [tp rank {rank}]: %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    _exit_with_parent()
    from conveyor.parallel.launch import threads_per_rank

    device = resolve_device(config.device)
    if device.type == "cpu":
        torch.set_num_threads(threads_per_rank(size))
    try:
        group = TPGroup(rank, size, device, timeout_from_env())
        runner = ModelRunner(config, model_path, tp=group)
        group.agree_min(runner.num_kv_blocks)  # rank 0 checks that every rank agrees
        serve(runner)
    except Exception:
        logger.exception("Tensor-parallel rank %d failed; it exits.", rank)
        os._exit(1)
    os._exit(0)  # rank 0 asked; nothing here needs tearing down
