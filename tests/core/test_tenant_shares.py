"""The tenant rule (core/tenant_shares.py): tenants share each step's time (issue 49 item 4:
4 requests of n=16 from one client held another client's 8-token request up ~9x)."""

from __future__ import annotations

import pytest
from tests.core.test_scheduler import CostClock

from conveyor.config import EngineConfig
from conveyor.core.scheduler import Scheduler
from conveyor.core.sequence import Sequence
from conveyor.core.tenant_shares import RowCost, TenantShares
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


def test_the_row_cost_line_finds_the_lightests_step_and_the_cost_of_a_row():
    cost = RowCost()
    assert cost.fit() is None
    for rows in [1, 0, 2, 1, 3, 0, 1, 2] * 3:
        cost.observe(rows, 0.004 + 0.002 * rows)
    alone, per_row = cost.fit()
    assert alone == pytest.approx(0.004) and per_row == pytest.approx(0.002)
    same = RowCost()
    for _ in range(20):  # steps all with as many rows cannot tell the two apart
        same.observe(2, 0.05)
    assert same.fit() is None


def test_the_lightest_tenant_gets_all_it_has_and_the_others_share_out_the_rest():
    shares = TenantShares()
    assert shares.allowances({"a": (16, 16)}, {"a": 16}) is None  # one tenant: no limit
    # Until the times are known: each other tenant its base (as many rows as the lightest
    # has requests), and one row beyond, in turn.
    work = {"a": (16, 16), "b": (1, 1), "c": (2, 2)}
    rows = {"a": 16, "b": 1, "c": 2}
    given = []
    for _ in range(4):
        allow = shares.allowances(work, rows)
        assert set(allow) == {"a", "c"} and sum(allow.values()) == 3  # b, the lightest: all
        given.append(max(allow, key=allow.get))
        shares.spend(3)
    assert given == ["a", "c", "a", "c"]
    # The fewest requests is the lightest, whatever its tokens: a prompt is not a row.
    assert set(shares.allowances({"a": (16, 16), "b": (1, 40)}, {"a": 16})) == {"a"}
    # Known times: a step alone 10 ms, a row 1 ms: the others get 0.5 x 10 = 5 rows a step,
    # their base (1 each) included.
    for r in [0, 1, 2, 3, 1, 0, 2, 4] * 4:
        shares.cost.observe(r, 0.010 + 0.001 * r)
    shares.credit = 0.0
    allow = shares.allowances({"a": (16, 16), "b": (1, 1), "c": (30, 30)}, rows | {"c": 30})
    assert sorted(allow.values()) == [2, 3] and set(allow) == {"a", "c"}
    # Tenants alike are never held back: three clients of one stream each.
    alike = shares.allowances({"a": (1, 1), "b": (1, 1), "c": (1, 1)}, {"a": 1, "b": 1, "c": 1})
    assert alike == {"b": 1, "c": 1}


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
    steady = request("steady", "steady", prompt=6, max_tokens=60)
    sched.add_request(steady)
    steps = []
    while not steady.is_finished:
        steps.append(clock.step(sched))
    alone = clock.BASE_S + clock.PER_TOKEN_S  # a decode step of the steady request alone
    times = [clock.BASE_S + clock.PER_TOKEN_S * o.total_num_scheduled_tokens for o in steps]
    # Once the times are measured, each of its steps takes at most 1 + SHARE times its own
    # (the attacker's one base row: 2 / 4 ms beside it).
    assert max(times[20:]) <= (1 + TenantShares.SHARE) * alone + 1e-9, times
    # The attacker still advances, every one of its samples in turn.
    served: dict[str, int] = {}
    for out in steps[20:36]:
        for rid in out.num_scheduled_tokens:
            served[rid] = served.get(rid, 0) + 1
    assert sorted(served.pop("steady") for _ in [0]) == [16]
    assert sorted(served) == sorted(r.request_id for r in samples)  # each once in 16 steps
    assert set(served.values()) == {1}


def test_the_engine_waits_for_a_client_that_comes_back_and_then_lets_go():
    clock = CostClock()
    clock.BASE_S, clock.PER_TOKEN_S = 0.002, 0.002
    sched = scheduler(clock)
    for i in range(16):
        sched.add_request(request(f"s{i}", "attacker", max_tokens=400))
    for _ in range(3):
        clock.step(sched)
    holds = []
    for i in range(10):  # a client sending one request after another, 1 ms apart
        steady = request(f"steady{i}", "steady", prompt=6, max_tokens=4)
        steady.arrival_time = clock.now
        sched.add_request(steady)
        assert sched.hold_s() == 0.0  # its request is here: no wait
        while not steady.is_finished:
            clock.step(sched)
        holds.append(sched.hold_s())
        clock.now += 0.001
    # Once a few of its gaps were seen, the engine waits about as long as they took rather
    # than run the 16 rows alone (8.5 of its steps), which its next request would wait for.
    assert holds[0] == 0.0
    assert holds[-4:] == [pytest.approx(0.001 + TenantShares.GAP_MARGIN_S)] * 4
    clock.now += 1.0  # it does not come back: no more waiting, the attacker has it all
    assert sched.hold_s() == 0.0
    assert clock.step(sched).total_num_scheduled_tokens == 16


def test_clients_alike_are_not_held_back_nor_a_new_clients_prompt():
    # 16 clients of one stream each all decode every step; a new client's prompt runs whole
    # beside them (its first token is not delayed): only decode rows are shared out.
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
