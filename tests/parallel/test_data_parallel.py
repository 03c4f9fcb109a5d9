"""Data-parallel parts without processes: the router's load counting, the replicas' placement,
the merged per-replica metrics, and the config's checks (issue 17, part 3); replicas taken down
and brought up again, and their restart counter (issue 27, item 8)."""

from __future__ import annotations

import os
import re

import pytest
from tests.serve_process import metric_value

from conveyor import LLM
from conveyor.config import EngineConfig
from conveyor.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from conveyor.entrypoints.replica_metrics import DataParallelMetrics
from conveyor.entrypoints.replica_placement import replica_placements
from conveyor.entrypoints.replica_router import ReplicaRouter
from conveyor.entrypoints.request_stream import EngineNotRunningError
from conveyor.server.config import build_serve_config

RESTARTS = "conveyor:replica_restarts_total"


def test_requests_go_to_the_replica_with_fewest_outstanding_tokens_ties_to_lowest() -> None:
    router = ReplicaRouter(3, max_model_len=1000)
    assert router.route("a", 10, 90, n=1) == 0  # all empty: the lowest index
    assert router.route("b", 5, 5, n=1) == 1
    assert router.route("c", 5, 5, n=1) == 2
    assert router.loads == [100, 10, 10]
    assert router.route("d", 1, 1, n=1) == 1  # 1 and 2 tie at 10: the lower one
    assert router.route("e", 1, 1, n=1) == 2
    assert router.loads == [100, 12, 12]
    assert [router.replica_of(r) for r in "abcde"] == [0, 1, 2, 1, 2]
    assert router.num_in_flight(1) == 2


def test_outstanding_tokens_count_prompt_n_samples_and_the_context_without_max_tokens() -> None:
    router = ReplicaRouter(2, max_model_len=64)
    router.route("n3", 4, 10, n=3)
    router.route("open", 14, None, n=1)  # up to the context: 14 + (64 - 14)
    assert router.loads == [34, 64]


def test_generated_tokens_and_finish_release_a_requests_load() -> None:
    router = ReplicaRouter(2, max_model_len=100)
    router.route("a", 10, 20, n=1)
    router.route("b", 10, 20, n=1)
    router.progress("a", 5, finished=False)
    assert router.loads == [25, 30]
    assert router.route("c", 1, 1, n=1) == 0  # replica 0 now has less outstanding
    router.progress("a", 3, finished=True)  # stopped early: everything it held is released
    router.progress("c", 1, finished=True)
    assert router.loads == [0, 30] and router.replica_of("a") is None
    assert router.num_in_flight(0) == 0
    router.progress("a", 7, finished=True)  # late or unknown ids change nothing
    router.release("b")  # rejected by its engine
    assert router.loads == [0, 0] and router.replica_of("b") is None


def test_an_abort_releases_through_its_final_output_and_the_id_may_be_reused() -> None:
    router = ReplicaRouter(2, max_model_len=100)
    router.route("x", 3, 30, n=1)
    with pytest.raises(ValueError, match="already in flight"):
        router.route("x", 3, 30, n=1)
    router.progress("x", 0, finished=True)  # the abort's final output
    assert router.loads == [0, 0]
    assert router.route("x", 3, 30, n=1) == 0


def test_cpu_replicas_get_disjoint_contiguous_core_groups(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    placements = replica_placements(2, "cpu")
    assert [p.cpu_cores for p in placements] == [(0, 1, 2), (3, 4)]
    assert all(p.env == {} for p in placements)
    with pytest.raises(ValueError, match=r"data_parallel_size=6 .* 5 core\(s\)"):
        replica_placements(6, "cpu")


def test_cuda_replicas_each_see_one_visible_device(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    placements = replica_placements(2, "cuda")
    assert [p.env for p in placements] == [
        {"CUDA_VISIBLE_DEVICES": "3"},
        {"CUDA_VISIBLE_DEVICES": "5"},
    ]
    assert all(p.cpu_cores is None for p in placements)
    with pytest.raises(ValueError, match="3 puts each replica on its own GPU, but 2 CUDA"):
        replica_placements(3, "cuda")


def _finished(request_id: str, num_tokens: int) -> RequestOutput:
    completion = CompletionOutput(
        0, "x" * num_tokens, list(range(num_tokens)), None, None, "length"
    )
    metrics = RequestMetrics(0.0, 0.1, 0.2, 0.3)
    return RequestOutput(request_id, None, [], [completion], True, None, metrics, 0)


def test_metrics_show_each_replica_and_totals_equal_to_their_sum() -> None:
    metrics = DataParallelMetrics("m", 0.0, 2)
    for replica, (num_requests, kv) in enumerate([(3, 0.5), (1, 0.1)]):
        target = metrics.replicas[replica]
        for i in range(num_requests):
            target.record_output(_finished(f"{replica}-{i}", 4), 7, None, 1.0)
        target.record_step(16, num_requests, 1, kv, replica, 0.01, 10 * (replica + 1), 2)
    text = metrics.render().decode()
    # One HELP and TYPE line per family (Prometheus rejects repeats).
    types = re.findall(r"^# TYPE (\S+)", text, re.M)
    assert len(types) == len(set(types)) and "conveyor:generation_tokens_total" in types
    for name, expected in [
        ("conveyor:generation_tokens_total", (12, 4)),
        ("conveyor:prompt_tokens_total", (21, 7)),
        ("conveyor:num_requests_running", (3, 1)),
        ("conveyor:num_preemptions_total", (0, 1)),
        ("conveyor:prefix_cache_queries_total", (10, 20)),
        ("conveyor:e2e_request_latency_seconds_count", (3, 1)),
        ("conveyor:iteration_tokens_total_bucket", (1, 1)),  # le="16"
    ]:
        labels = {"le": "16.0"} if name.endswith("_bucket") else {}
        per = [metric_value(text, name, replica=str(i), **labels) for i in range(2)]
        assert per == list(expected), name
        assert metric_value(text, name, replica="all", **labels) == sum(expected), name
    ok = {"finished_reason": "length"}
    assert metric_value(text, "conveyor:request_success_total", replica="all", **ok) == 4
    # The pooled KV usage: every replica has as many blocks, so the mean.
    assert metric_value(text, "conveyor:kv_cache_usage_perc", replica="all") == pytest.approx(0.3)
    assert 'replica="all"' not in "".join(line for line in text.splitlines() if "_created" in line)


def test_data_parallel_size_must_be_a_positive_integer() -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        EngineConfig(data_parallel_size=0)


def test_replicas_of_a_tensor_parallel_engine_are_refused() -> None:
    with pytest.raises(ValueError, match="data_parallel_size=2 with tensor_parallel_size=2"):
        EngineConfig(data_parallel_size=2, tensor_parallel_size=2)


def test_the_offline_llm_refuses_data_parallel_replicas_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"data_parallel_size=2: .*--data-parallel-size"):
        LLM(data_parallel_size=2)


def test_serve_refuses_replicas_with_the_engine_in_a_thread() -> None:
    overrides = {"data_parallel_size": 2, "engine_process": False}
    with pytest.raises(ValueError, match="drop --no-engine-process"):
        build_serve_config(None, overrides)


def test_a_replica_taken_down_gets_no_requests_and_hands_back_what_it_held() -> None:
    router = ReplicaRouter(2, max_model_len=100)
    router.route("a", 10, 10, n=1)
    router.route("b", 10, 10, n=1)
    router.route("c", 10, 10, n=1)
    assert router.take_down(0) == ["a", "c"]  # its engine died: these never finish there
    assert router.num_serving == 1 and router.loads == [0, 20]
    assert router.replica_of("a") is None and router.num_in_flight(0) == 0
    assert router.route("d", 1, 1, n=1) == 1  # the less loaded one is down
    assert router.take_down(1) == ["b", "d"]
    with pytest.raises(EngineNotRunningError, match="No data-parallel replica serves"):
        router.route("e", 1, 1, n=1)
    router.bring_up(0)  # restarted
    assert router.route("e", 1, 1, n=1) == 0 and router.num_serving == 1


def test_restarts_are_counted_per_replica_from_zero() -> None:
    metrics = DataParallelMetrics("m", 0.0, 2)
    assert [metric_value(metrics.render().decode(), RESTARTS, replica=r) for r in "01"] == [0, 0]
    metrics.record_replica_restart(1)
    metrics.record_replica_restart(1)
    assert [metric_value(metrics.render().decode(), RESTARTS, replica=r) for r in "01"] == [0, 2]


def test_max_replica_restarts_must_be_a_non_negative_integer() -> None:
    assert build_serve_config(None, {"max_replica_restarts": 0})[1].max_replica_restarts == 0
    with pytest.raises(ValueError, match="max_replica_restarts"):
        build_serve_config(None, {"max_replica_restarts": -1})
