"""Tensor-parallel lifecycle (issue 27, item 9): `LLM.shutdown()` and `with LLM(...)` stop
the worker processes and leave the torch.distributed group; a dropped LLM (`del`, no
shutdown) does the same through its finalizer, so four tensor_parallel_size=2 LLMs built in
turn in one process all start. `AsyncLLM.shutdown()` and `async with` do the same for an
in-process engine. Real worker processes (gloo on 127.0.0.1) on the tiny demo model.

Before: after `del llm` the rank-1 worker kept running and the next LLM was refused ("a
tensor-parallel engine ... is already running").
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch.distributed as dist

from conveyor import LLM, SamplingParams
from conveyor.entrypoints.async_llm import AsyncLLM

pytestmark = pytest.mark.slow  # tensor-parallel worker processes start

TINY = dict(tensor_parallel_size=2, num_kv_blocks=8, block_size=8, max_num_seqs=2)
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPT = [5, 6, 7]


def _workers(llm: LLM) -> list:
    return list(llm.llm_engine.runner.tp_workers.procs)


def _gone(procs: list) -> bool:
    return all(p.poll() is not None for p in procs)


def test_four_dropped_tp_llms_in_turn_each_release_their_workers(demo_model_dir) -> None:
    seen, previous = [], []
    for _ in range(4):
        llm = LLM(str(demo_model_dir), **TINY)  # refused before, from the second on
        assert _gone(previous), "the dropped LLM's worker still runs"
        seen.append(llm.generate([PROMPT], PARAMS, use_tqdm=False)[0].outputs[0].token_ids)
        previous = _workers(llm)
        del llm  # no shutdown()
    gc.collect()  # a reference cycle, if any, is collected here at the latest
    assert _gone(previous) and not dist.is_initialized()
    assert all(tokens == seen[0] for tokens in seen) and len(seen[0]) == 3


def test_four_tp_llms_in_turn_with_a_context_manager(demo_model_dir) -> None:
    seen = []
    for _ in range(4):
        with LLM(str(demo_model_dir), **TINY) as llm:
            seen.append(llm.generate([PROMPT], PARAMS, use_tqdm=False)[0].outputs[0].token_ids)
            workers = _workers(llm)
        # Left at once on exit: no garbage collection needed.
        assert _gone(workers) and not dist.is_initialized()
    assert all(tokens == seen[0] for tokens in seen)
    llm.shutdown()  # idempotent
    with pytest.raises(ValueError, match="this LLM was shut down"):
        llm.generate([PROMPT], PARAMS, use_tqdm=False)


def test_shutdown_is_idempotent_without_tensor_parallelism(demo_model_dir) -> None:
    llm = LLM(str(demo_model_dir), num_kv_blocks=8)
    llm.shutdown()
    llm.shutdown()
    with pytest.raises(ValueError, match="this LLM was shut down"):
        llm.chat([{"role": "user", "content": "hi"}], PARAMS, use_tqdm=False)


def test_async_llm_shutdown_and_async_with_release_the_workers(demo_model_dir) -> None:
    async def twice() -> list[list[int]]:
        seen = []
        for _ in range(2):
            async with AsyncLLM(str(demo_model_dir), **TINY) as engine:
                async for out in engine.generate(PROMPT, PARAMS):
                    tokens = out.outputs[0].token_ids
                workers = list(engine.engine.runner.tp_workers.procs)
            assert _gone(workers) and not dist.is_initialized()
            await engine.shutdown()  # idempotent
            seen.append(tokens)
        return seen

    first, second = asyncio.run(twice())
    assert first == second and len(first) >= 1
