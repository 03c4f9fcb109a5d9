"""The server's grammar checks in a worker process (structured/grammar_checker.py): a check
past its deadline is killed (its CPU freed), waiting counts against the deadline, a check's
memory is bounded, lanes keep cheap checks apart from costly ones, each client has a quota.

Real worker processes on the demo model's tokenizer; assertions are on results, order and
process counts, with time bounds only far above what the checks need.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from tests.process_tree import children
from tests.serve_process import held_grammar_worker_env

from conveyor.engine.tokenizer import Tokenizer
from conveyor.structured.grammar import GrammarError, GrammarTimeoutError
from conveyor.structured.grammar_checker import (
    MAX_COMPILE_COST,
    GrammarChecker,
    GrammarCheckerUnavailableError,
    TooManyGrammarChecksError,
)
from conveyor.structured_params import StructuredOutputsParams

pytest.importorskip("xgrammar")

VOCAB = 8192  # the demo model's


def _checker(demo_model_dir: Path, **kw) -> GrammarChecker:
    options = {"timeout_s": 30.0, **kw}
    hf = Tokenizer.from_pretrained(str(demo_model_dir)).hf
    return GrammarChecker(hf, VOCAB, [0], options.pop("timeout_s"), **options)


def _optional_terms(n: int, tag: str = "") -> StructuredOutputsParams:
    """An EBNF of n optional two-letter terms: its compile time grows with n squared (800:
    ~10 s on the demo vocabulary), and `tag` makes each one a new constraint."""
    terms = " ".join(f'"{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}"?' for i in range(n))
    return StructuredOutputsParams(grammar=f'root ::= "{tag}" {terms}')


def _small(tag: str = "") -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=f"{tag}[0-9]{{2}}w")


async def _outcome(checker: GrammarChecker, so, client: str = "a") -> tuple[str, float]:
    try:
        await checker.check(so, f"structured_outputs.{so.kind}", client)
        result = "ok"
    except GrammarTimeoutError:
        result = "timeout"
    except TooManyGrammarChecksError:
        result = "429"
    except GrammarError as exc:
        result = f"400: {exc}"
    return result, time.monotonic()


def test_a_grammar_with_no_finite_output_is_refused_and_nothing_compiles(demo_model_dir):
    async def main():
        checker = _checker(demo_model_dir)
        try:
            result, _ = await _outcome(
                checker, StructuredOutputsParams(grammar='root ::= "a" root')
            )
            assert result.startswith("400") and "no finite output" in result
            assert (await _outcome(checker, _small()))[0] == "ok"  # the worker is fine
        finally:
            checker.close()

    asyncio.run(main())


def test_a_check_past_its_deadline_is_killed_and_the_one_queued_behind_it_never_starts(
    demo_model_dir,
):
    """Issue 49 item 2: before, a timed-out compile ran on in its thread for minutes, and a
    compile waiting to start had no deadline at all."""

    async def main():
        checker = _checker(demo_model_dir, timeout_s=2.0)
        try:
            await _outcome(checker, _small("warm"))  # the worker started (not counted below)
            worker = checker._proc.pid
            # Both costly (the slow lane, one slot): the second waits, and its wait counts.
            first = asyncio.ensure_future(_outcome(checker, _optional_terms(800, "x")))
            second = asyncio.ensure_future(_outcome(checker, _optional_terms(800, "y")))
            (r1, _), (r2, _) = await first, await second
            assert (r1, r2) == ("timeout", "timeout")
            assert checker.num_killed == 1  # only the first ever ran
            for _ in range(50):  # the kill is asynchronous: the child is gone within moments
                if not children(worker):
                    break
                await asyncio.sleep(0.1)
            assert children(worker) == []
            # A constraint that timed out fails at once when asked again: nothing runs.
            checks = checker.num_checks
            assert (await _outcome(checker, _optional_terms(800, "x")))[0] == "timeout"
            assert checker.num_checks == checks
        finally:
            checker.close()

    asyncio.run(main())


def test_a_cheap_check_is_not_held_up_by_costly_ones(demo_model_dir):
    async def main():
        checker = _checker(demo_model_dir, timeout_s=60.0)
        try:
            await _outcome(checker, _small("warm"))
            costly = [asyncio.ensure_future(_outcome(checker, _optional_terms(600, t), "attacker"))
                      for t in "pq"]  # fmt: skip
            await asyncio.sleep(0.3)
            cheap = await _outcome(checker, _small("steady"), "steady")
            assert cheap[0] == "ok"
            assert not any(c.done() for c in costly)  # finished while they still compile
            for c in costly:
                c.cancel()
        finally:
            checker.close()

    asyncio.run(main())


def test_a_client_has_a_quota_of_checks_in_flight(demo_model_dir):
    async def main():
        checker = _checker(demo_model_dir, timeout_s=60.0, max_per_client=2)
        try:
            await _outcome(checker, _small("warm"))
            running = [asyncio.ensure_future(_outcome(checker, _optional_terms(600, t)))
                       for t in "uv"]  # fmt: skip
            await asyncio.sleep(0.1)
            assert (await _outcome(checker, _small("third")))[0] == "429"
            assert (await _outcome(checker, _small("other"), "b"))[0] == "ok"  # another client
            for r in running:
                r.cancel()
        finally:
            checker.close()

    asyncio.run(main())


def test_an_estimated_cost_far_past_any_deadline_is_refused_before_compiling(demo_model_dir):
    """2,900 optional terms compile for minutes: refused by the estimate, in milliseconds."""

    async def main():
        checker = _checker(demo_model_dir)
        try:
            result, _ = await _outcome(checker, _optional_terms(4000))
            assert result.startswith("400") and f"{MAX_COMPILE_COST:.2g}" in result
            assert checker.num_killed == checker.num_demoted == 0
        finally:
            checker.close()

    asyncio.run(main())


def test_a_check_over_its_memory_budget_is_a_400_and_the_next_check_runs(demo_model_dir):
    # 5,000 positions: ~15 MB of token masks to compile, past a 1 MiB budget (and the free
    # heap a forked check starts with).
    terms = " ".join(f'"{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}" [a-z]' for i in range(5000))
    big = StructuredOutputsParams(grammar=f"root ::= {terms}")

    async def main():
        tight = _checker(demo_model_dir, memory_mb=1)
        try:
            result, _ = await _outcome(tight, big)
            assert result.startswith("400") and "--grammar-memory-limit" in result
            assert (await _outcome(tight, _small("after")))[0] == "ok"  # the worker lives on
        finally:
            tight.close()
        roomy = _checker(demo_model_dir)
        try:
            assert (await _outcome(roomy, big))[0] == "ok"
        finally:
            roomy.close()

    asyncio.run(main())


def test_close_kills_the_checks_in_flight_at_once(demo_model_dir):
    """Shutdown never waits for a compile (issue 49 item 8)."""

    async def main():
        checker = _checker(demo_model_dir, timeout_s=600.0)
        await _outcome(checker, _small("warm"))
        proc = checker._proc
        pending = asyncio.ensure_future(checker.check(_optional_terms(900, "z"), "g", "a"))
        await asyncio.sleep(0.5)
        checker.close()
        with pytest.raises(GrammarCheckerUnavailableError):
            await pending
        assert proc.poll() is not None

    asyncio.run(main())


# After close() (the server stops), no check may wait on a worker that nobody answers for or
# start one: before, each of the three cases below left its request hanging, until uvicorn's
# shutdown backstop cut it with a 500.


def test_close_fails_a_check_waiting_for_the_worker_to_start(demo_model_dir, tmp_path, monkeypatch):
    for name, value in held_grammar_worker_env(tmp_path).items():
        monkeypatch.setenv(name, value)  # the worker never gets ready

    async def main():
        checker = _checker(demo_model_dir)
        pending = asyncio.ensure_future(checker.check(_small(), "g", "a"))
        while checker._proc is None:  # set just before the start waits for the worker
            await asyncio.sleep(0.01)
        proc = checker._proc
        checker.close()
        with pytest.raises(GrammarCheckerUnavailableError, match="shutting down"):
            await asyncio.wait_for(pending, 60)  # before: never answered
        assert proc.poll() is not None

    asyncio.run(main())


def test_close_while_the_vocabulary_is_read_starts_no_worker(demo_model_dir):
    async def main():
        checker = _checker(demo_model_dir)
        reading, go_on = threading.Event(), threading.Event()
        read = checker._tokenizer_info

        def held_read() -> str:
            reading.set()
            go_on.wait(60)
            return read()

        checker._tokenizer_info = held_read
        pending = asyncio.ensure_future(checker.check(_small(), "g", "a"))
        try:
            while not reading.is_set():
                await asyncio.sleep(0.01)
            checker.close()
            go_on.set()
            with pytest.raises(GrammarCheckerUnavailableError, match="shutting down"):
                await asyncio.wait_for(pending, 60)
            assert checker._proc is None
        finally:
            go_on.set()
            checker.close()

    asyncio.run(main())


def test_a_check_after_close_fails_at_once_and_starts_no_worker(demo_model_dir):
    async def main():
        checker = _checker(demo_model_dir)
        assert (await _outcome(checker, _small("warm")))[0] == "ok"
        checker.close()
        for so in (_small("warm"), _small("new")):  # cached or not
            with pytest.raises(GrammarCheckerUnavailableError, match="shutting down"):
                await asyncio.wait_for(checker.check(so, "g", "a"), 60)
        assert checker._proc is None

    asyncio.run(main())
