"""A fault in one request fails that request alone; a KV cache far too small still serves all.

Faults are injected where no real part can fail on demand: a non-finite logit in the model's
output for one request (before the real logits guard), and an exception in one request's
token-level stop check (core), detokenizer or stop-string check. The request that carries the
marker stop string fails with a 500 error body (or an error event in its stream); the requests
in the same batch finish with exactly the tokens they get without the fault, and the engine
stays healthy and idle.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conveyor import LLM, AsyncLLM, SamplingParams
from conveyor.core.sequence import Sequence
from conveyor.engine.tokenizer import IncrementalDetokenizer
from conveyor.model.sampling.logits_guard import FiniteLogitsGuard
from conveyor.server.app import build_app

POISON = "\x00poison"  # a stop string no output contains: marks the request to break
PROMPTS = ["One two three", "The quick brown fox", "def add(a, b):"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected(demo_model_dir) -> list[str]:
    llm = LLM(str(demo_model_dir), num_kv_blocks=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _inject(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """Make every request whose stop strings include POISON fail at `fault`."""
    if fault == "logits":
        real_guard = FiniteLogitsGuard.__call__

        def nan_logits(self, logits, requests):
            rows = [i for i, r in enumerate(requests) if POISON in r.sampling_params.stop_strings]
            if rows:
                logits = logits.clone()
                logits[rows, 7] = float("nan")
            return real_guard(self, logits, requests)

        monkeypatch.setattr(FiniteLogitsGuard, "__call__", nan_logits)
        return
    if fault == "token stop check":  # core: eos, stop_token_ids, max_tokens
        real_check = Sequence.check_stop

        def faulty_check(self):
            if POISON in self.sampling_params.stop_strings:
                raise RuntimeError("injected fault")
            return real_check(self)

        monkeypatch.setattr(Sequence, "check_stop", faulty_check)
        return
    method = {"detokenizer": "update", "stop check": "_check_stop"}[fault]
    real = getattr(IncrementalDetokenizer, method)

    def faulty(self, *args, **kwargs):
        if POISON in self.stop_strings:
            raise RuntimeError("injected fault")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(IncrementalDetokenizer, method, faulty)


async def _until_idle(llm: AsyncLLM) -> None:
    for _ in range(500):
        if not llm.engine.has_unfinished_requests() and llm.engine.scheduler.kv_usage == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine did not become idle")


@pytest.mark.parametrize("fault", ["logits", "token stop check", "detokenizer", "stop check"])
def test_a_faulty_request_fails_alone_and_the_batch_goes_on(
    demo_model_dir, expected, monkeypatch, fault
) -> None:
    _inject(monkeypatch, fault)

    async def run() -> None:
        llm = AsyncLLM(str(demo_model_dir), num_kv_blocks=64, log_stats_interval_s=0)
        app = build_app(llm)
        await llm.start()
        transport = httpx.ASGITransport(app=app)
        base = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

            def post(prompt: str, **extra: object):
                return client.post("/v1/completions", json={"prompt": prompt, **base, **extra})

            poisoned = {"stop": [POISON]}
            responses = await asyncio.gather(
                *(post(p) for p in PROMPTS),
                post("Fail me", **poisoned),
                post("Fail my stream", **poisoned, stream=True),
            )
            *good, failed, failed_stream = responses
            for resp, text in zip(good, expected, strict=True):
                assert resp.status_code == 200
                choice = resp.json()["choices"][0]
                assert (choice["text"], choice["finish_reason"]) == (text, "length")
            assert failed.status_code == 500
            error = failed.json()["error"]
            assert error["type"] == "InternalServerError" and error["code"] == 500
            assert "injected fault" not in error["message"]  # internals stay in the log
            events = failed_stream.text.split("\n\n")
            assert failed_stream.status_code == 200 and events[-2:] == ["data: [DONE]", ""]
            assert json.loads(events[-3].removeprefix("data: "))["error"]["code"] == 500
            await _until_idle(llm)
            assert (await client.get("/health")).status_code == 200
            again = await post(PROMPTS[0])
            assert again.json()["choices"][0]["text"] == expected[0]
        await llm.shutdown()

    asyncio.run(run())


def test_kv_cache_far_too_small_preempts_and_every_request_ends(demo_model_dir) -> None:
    # 6 blocks of 16 slots; 12 requests that each end up needing 3 of them.
    prompts = [f"Sequence {i} says" for i in range(12)]
    params = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True, logprobs=2)
    roomy = LLM(str(demo_model_dir), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)

    async def run() -> list[tuple[list[int], str | None, int]]:
        llm = AsyncLLM(str(demo_model_dir), num_kv_blocks=6, log_stats_interval_s=0)

        async def one(prompt: str) -> tuple[list[int], str | None, int]:
            ids, finish = [], None
            async for out in llm.generate(prompt, params):
                ids += out.outputs[0].token_ids
                finish = out.outputs[0].finish_reason
            return ids, finish, len(ids)

        results = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 300)
        await _until_idle(llm)
        assert llm.engine.scheduler.num_preemptions > 0
        await llm.shutdown()
        return results

    results = asyncio.run(run())
    assert [r[1:] for r in results] == [("length", 36)] * len(prompts)
    # Recompute after preemption reruns generated tokens as prefill, whose attention sums in
    # another order than decode's: exact tokens, except that a random-weight model may flip
    # a near-tie (top-2 logprobs within 1e-4 in the uninterrupted run), after which the two
    # continuations are different texts.
    for (ids, _, _), ref in zip(results, roomy, strict=True):
        ref_ids = ref.outputs[0].token_ids
        k = next((i for i, (a, b) in enumerate(zip(ids, ref_ids, strict=True)) if a != b), None)
        if k is not None:
            top = ref.outputs[0].logprobs[k]
            assert ids[k] in top and ref_ids[k] in top, (k, top)
            assert abs(top[ids[k]].logprob - top[ref_ids[k]].logprob) < 1e-4, (k, top)
