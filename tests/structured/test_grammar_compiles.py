"""Grammar compiles in the engine: two lanes, a time limit, cancellation, deadlines.

The slow constraint is a schema within every limit of structured/limits.py that still takes
about a second to compile (7 objects of 250 optional properties: ~0.9 s on the demo model's
tokenizer, on a loaded 2-core machine); the small one is a regex that compiles in about a
millisecond. The tests assert on the order things finish in, not on durations.
"""

from __future__ import annotations

import time

import pytest
from tests.structured.structured_schemas import slow_schema

from conveyor import LLM, SamplingParams
from conveyor.engine.tokenizer import Tokenizer
from conveyor.structured.grammar import GrammarTimeoutError
from conveyor.structured.grammar_cache import GrammarCache
from conveyor.structured_params import StructuredOutputsParams


def _so(tag: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=slow_schema(tag))


SMALL = StructuredOutputsParams(regex="[0-9]{2}w")


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_model_dir)


def _cache(tokenizer: Tokenizer, timeout_s: float = 60.0) -> GrammarCache:
    return GrammarCache(tokenizer.hf, tokenizer.vocab_size, tokenizer.eos_token_ids, timeout_s)


def _poll_until(cache: GrammarCache, done, limit_s: float = 120.0) -> None:
    end = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < end, "timed out waiting"
        cache.poll()
        time.sleep(0.01)


def test_a_small_grammar_never_waits_behind_big_ones(tokenizer) -> None:
    """Before: one compile thread, first come first served; the regex waited for both."""
    cache = _cache(tokenizer)
    big = [cache.get(_so("lane-a")), cache.get(_so("lane-b"))]
    small = cache.get(SMALL)
    small.future.result(timeout=60)
    assert not big[1].future.done()  # still queued behind the first big one, or compiling
    for job in big:
        job.future.result(timeout=120)


def test_a_compile_past_the_time_limit_fails_its_job_and_hands_the_lane_on(tokenizer) -> None:
    cache = _cache(tokenizer, timeout_s=0.05)
    first = cache.get(_so("limit-a"))
    _poll_until(cache, first.future.done)
    with pytest.raises(GrammarTimeoutError, match=r"grammar_compile_timeout \(0.05 s\)"):
        first.future.result()
    assert cache.num_timeouts == 1
    # The timed-out compile runs on in its thread (xgrammar cannot stop it), yet the next big
    # constraint starts at once instead of queueing behind it.
    second = cache.get(_so("limit-b"))
    _poll_until(cache, lambda: second.started_at is not None)
    assert cache.num_compiles == 0  # the first one's compile has not finished yet
    # Asked again, the slow one fails at once (or, should its compile have finished after
    # all, is a cache hit): it never queues again.
    assert cache.get(_so("limit-a")).future.done()
    _poll_until(cache, lambda: cache.num_compiles >= 2)
    assert cache.get(_so("limit-a")).future.result(timeout=1) is not None  # the result kept
    cache.shutdown()


def test_a_queued_compile_nobody_waits_for_is_cancelled(tokenizer) -> None:
    cache = _cache(tokenizer)
    running = cache.get(_so("cancel-a"))
    queued = cache.get(_so("cancel-b"))
    later = cache.get(_so("cancel-c"))
    cache.release(queued)  # its request was aborted, or its client went away
    assert queued.future.cancelled()
    running.future.result(timeout=120)
    later.future.result(timeout=120)
    assert cache.num_compiles == 2  # the cancelled one never compiled
    assert not cache.get(_so("cancel-b")).future.cancelled()  # asked again: compiled anew
    cache.shutdown()


# ---------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def llm(demo_model_dir) -> LLM:
    return LLM(str(demo_model_dir), num_kv_blocks=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def strict_llm(demo_model_dir) -> LLM:
    return LLM(str(demo_model_dir), num_kv_blocks=64, max_num_seqs=8, grammar_compile_timeout=0.1)


def _run(engine) -> dict:
    """Step until idle; the final outputs by request id, in the order they finished."""
    finished: dict = {}
    end = time.monotonic() + 300
    while engine.has_unfinished_requests():
        assert time.monotonic() < end
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_a_deadline_counts_while_the_grammar_compiles(llm) -> None:
    """Before: the deadline was checked only once the request reached the scheduler, after
    its compile (45 s after a 2 s deadline)."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("first", "x", SamplingParams(max_tokens=2, structured_outputs=_so("dl-a")))
    engine.add_request("second", "x", SamplingParams(max_tokens=2, structured_outputs=_so("dl-b")))
    late = SamplingParams(max_tokens=2, deadline=0.2, structured_outputs=_so("dl-c"))
    engine.add_request("late", "x", late)
    engine.add_request("plain", "x", params)
    finished = _run(engine)
    order = list(finished)
    assert order.index("late") < order.index("second")
    out = finished["late"].outputs[0]
    assert out.finish_reason == "abort" and out.abort_reason.startswith("deadline exceeded")
    assert finished["first"].error is None and finished["plain"].error is None


def test_an_aborted_request_gives_up_its_queued_compile(llm) -> None:
    engine = llm.llm_engine
    cache = engine.grammars
    engine.add_request("a", "x", SamplingParams(max_tokens=1, structured_outputs=_so("ab-a")))
    engine.add_request("b", "x", SamplingParams(max_tokens=1, structured_outputs=_so("ab-b")))
    compiles = cache.num_compiles
    (out,) = engine.abort_request("b")
    assert out.outputs[0].finish_reason == "abort"
    _run(engine)
    assert cache.num_compiles - compiles == 1  # "b"'s compile never ran


def test_a_compile_past_the_time_limit_is_the_requests_own_error(strict_llm) -> None:
    engine = strict_llm.llm_engine
    engine.add_request("slow", "x", SamplingParams(max_tokens=4, structured_outputs=_so("own")))
    engine.add_request("quick", "x", SamplingParams(max_tokens=3, structured_outputs=SMALL))
    engine.add_request("plain", "x", SamplingParams(max_tokens=3, ignore_eos=True))
    finished = _run(engine)
    slow = finished["slow"]
    assert slow.outputs[0].finish_reason == "abort" and slow.error_param == "structured_outputs"
    assert "grammar_compile_timeout (0.1 s)" in slow.error
    assert finished["quick"].error is None and finished["plain"].error is None
    assert len(finished["plain"].outputs[0].token_ids) == 3


def test_a_grammar_that_dead_ends_is_the_requests_own_error(llm) -> None:
    """`a[^\\s\\S]` allows "a" and then nothing: before, the request failed as an engine
    fault (GrammarRejectedError, a 500)."""
    engine = llm.llm_engine
    dead = SamplingParams(max_tokens=8, temperature=1.0, seed=1,
                          structured_outputs={"regex": r"a[^\s\S]"})  # fmt: skip
    engine.add_request("dead", "x", dead)
    engine.add_request("nothing", "x", SamplingParams(structured_outputs={"regex": r"[^\s\S]"}))
    engine.add_request("plain", "x", SamplingParams(max_tokens=3, ignore_eos=True))
    finished = _run(engine)
    for rid in ("dead", "nothing"):
        out = finished[rid]
        assert out.error_param == "structured_outputs", out.error
        assert "can never be satisfied" in out.error
        assert out.outputs[0].finish_reason == "abort"
    assert finished["plain"].error is None
