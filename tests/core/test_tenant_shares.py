"""The tenant rule (core/tenant_shares.py): tenants share each step's time (issue 49 item 4:
4 requests of n=16 from one client held another client's 8-token request up ~9x)."""

from __future__ import annotations

import pytest
from tests.core.test_scheduler import CostClock

from conveyor.config import EngineConfig
from conveyor.core.scheduler import Scheduler
from conveyor.core.sequence import Sequence
from conveyor.core.tenant_shares import StepCost, TenantShares
from conveyor.sampling_params import SamplingParams


def request(rid: str, tenant: str, prompt: int = 4, max_tokens: int = 200) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, tenant=tenant)
    return Sequence(rid, list(range(100, 100 + prompt)), params, max_tokens=max_tokens)


def scheduler(clock: CostClock) -> Scheduler:
    config = EngineConfig(
        max_num_seqs=32, max_num_batched_tokens=2048, block_size=8, num_kv_blocks=1024,
        max_model_len=4096, enable_prefix_caching=False,
    )  # fmt: skip
    return Scheduler(config, clock=clock)


def test_the_step_cost_fit_finds_the_fixed_part_and_the_cost_of_a_token():
    cost = StepCost()
    assert cost.fit() is None
    for tokens in [1, 17, 2, 16, 3, 1, 17, 9] * 3:
        cost.observe(tokens, 0.004 + 0.002 * tokens)
    fixed, per_token = cost.fit()
    assert fixed == pytest.approx(0.004) and per_token == pytest.approx(0.002)
    same = StepCost()
    for _ in range(20):  # steps all of one size cannot tell the two apart
        same.observe(16, 0.05)
    assert same.fit() is None


def test_the_lightest_tenant_gets_all_it_has_and_the_others_split_the_rest():
    shares = TenantShares()
    assert shares.allowances({"a": 16}, {"a": 16}) is None  # one tenant: no limit
    # Unknown step costs: the others' decode rows are half the lightest's tokens, at least one.
    assert shares.allowances({"a": 16, "b": 1}, {"a": 16, "b": 1}) == {"a": 1}
    assert shares.allowances({"a": 16, "b": 40}, {"a": 16}) == {}  # b, prefilling, is lightest
    assert shares.allowances({"a": 16, "b": 41}, {"a": 16, "b": 1}) == {"b": 1}
    for tokens in [1, 17, 2, 16, 3, 9] * 4:  # a step's fixed part costs 10 tokens
        shares.cost.observe(tokens, 0.010 + 0.001 * tokens)
    # others: 0.5 x (10 + 2) = 6 rows, split evenly; one needing fewer leaves it to the rest
    tokens = {"a": 16, "b": 2, "c": 30}
    assert shares.allowances(tokens, {"a": 16, "b": 2, "c": 30}) == {"a": 3, "c": 3}
    assert shares.allowances(tokens, {"a": 1, "b": 2, "c": 30}) == {"a": 1, "c": 5}


def test_a_steady_request_beside_another_tenants_sixteen_samples_keeps_its_steps_short():
    # A step's fixed part costs as much as one row (a small model on a CPU): 16 rows of
    # another tenant would make each of the steady client's steps 8.5x longer.
    clock = CostClock()
    clock.BASE_S, clock.PER_TOKEN_S = 0.002, 0.002
    sched = scheduler(clock)
    samples = [request(f"s{i}", "attacker", max_tokens=400) for i in range(16)]
    for r in samples:
        sched.add_request(r)
    for _ in range(5):
        clock.step(sched)
    steady = request("steady", "steady", prompt=6, max_tokens=8)
    sched.add_request(steady)
    steps = []
    while not steady.is_finished:
        steps.append(clock.step(sched))
    alone = clock.BASE_S + clock.PER_TOKEN_S  # a decode step of the steady request alone
    times = [clock.BASE_S + clock.PER_TOKEN_S * o.total_num_scheduled_tokens for o in steps]
    # Its prompt step (before any step beside it was timed) aside, each of its steps takes
    # at most 1 + SHARE times its own.
    assert max(times[2:]) <= (1 + TenantShares.SHARE) * alone + 1e-9, times
    # The attacker still advances, every one of its samples in turn.
    served: dict[str, int] = {}
    for out in steps[2:]:
        for rid in out.num_scheduled_tokens:
            served[rid] = served.get(rid, 0) + 1
    attacker = [rid for rid in served if rid != "steady"]
    assert len(attacker) == len(steps) - 2 <= len(samples)  # a different one each step
    assert all(served[rid] == 1 for rid in attacker)


def test_the_share_holds_for_a_client_that_comes_back_and_then_lets_go():
    clock = CostClock()
    clock.BASE_S, clock.PER_TOKEN_S = 0.002, 0.002
    sched = scheduler(clock)
    for i in range(16):
        sched.add_request(request(f"s{i}", "attacker", max_tokens=400))
    for _ in range(3):
        clock.step(sched)
    steady = request("steady", "steady", prompt=6, max_tokens=4)
    sched.add_request(steady)
    while not steady.is_finished:
        clock.step(sched)
    # Its next request comes within GRACE_STEPS steps: those steps stay short for it.
    after = [clock.step(sched).total_num_scheduled_tokens for _ in range(4)]
    assert after[: TenantShares.GRACE_STEPS] == [1] * TenantShares.GRACE_STEPS
    assert after[TenantShares.GRACE_STEPS :] == [16, 16]  # then the attacker has it all


def test_another_tenants_prompt_is_not_held_back():
    # A new client's prompt runs whole beside 16 other clients' decodes (its first token is
    # not delayed); only decode rows are shared out.
    clock = CostClock()
    clock.BASE_S, clock.PER_TOKEN_S = 0.002, 0.002
    sched = scheduler(clock)
    for i in range(16):
        sched.add_request(request(f"s{i}", f"client{i}"))
    clock.step(sched)
    assert clock.step(sched).total_num_scheduled_tokens == 16  # one row each
    sched.add_request(request("new", "new", prompt=200))
    assert clock.step(sched).num_scheduled_tokens["new"] == 200


def test_one_tenant_is_never_limited():
    clock = CostClock()
    sched = scheduler(clock)
    for i in range(16):
        sched.add_request(request(f"s{i}", ""))
    clock.step(sched)
    sched.add_request(request("late", "", prompt=6))
    assert clock.step(sched).total_num_scheduled_tokens == 16 + 6


def test_llm_generate_takes_a_tenant_per_prompt(demo_model_dir, monkeypatch):
    from conveyor import LLM

    seen: list[str] = []
    real_add = Scheduler.add_request
    monkeypatch.setattr(
        Scheduler, "add_request", lambda self, req: (seen.append(req.tenant), real_add(self, req))
    )
    llm = LLM(str(demo_model_dir), num_kv_blocks=64)
    params = SamplingParams(max_tokens=2, temperature=0)
    alone = llm.generate(["a b", "c d"], params, use_tqdm=False)
    shared = llm.generate(["a b", "c d"], params, use_tqdm=False, tenant=["x", "y"])
    assert seen == ["", "", "x", "y"]
    assert [o.outputs[0].token_ids for o in shared] == [o.outputs[0].token_ids for o in alone]
    with pytest.raises(ValueError, match="tenant"):
        llm.generate(["a b", "c d"], params, use_tqdm=False, tenant=["x"])
    assert params.tenant == ""  # the caller's params are left as they were
