"""DataParallelMetrics: the Prometheus series of N data-parallel replicas, and their totals.

Each replica has its own EngineMetrics (every series labelled `replica="0"`, `"1"`, ..., as
vLLM labels its engines with `engine`). /metrics shows those series and, in the same metric
families, a total with `replica="all"`:

    conveyor:generation_tokens_total{model_name="m",replica="0"} 120.0
    conveyor:generation_tokens_total{model_name="m",replica="1"} 118.0
    conveyor:generation_tokens_total{model_name="m",replica="all"} 238.0

Counters, histograms (every bucket, _sum and _count) and the running / waiting gauges total
as sums. `kv_cache_usage_perc` totals as the mean: every replica has the same number of
blocks, so the mean is the fraction of all the replicas' blocks in use. In PromQL, select
`replica="all"` for totals, or `replica!="all"` to aggregate replicas yourself (summing every
series would count each token twice).

`conveyor:replica_restarts_total{replica="i"}` counts the restarts of replica i after its
engine died (data_parallel.py's degraded mode); it has no "all" series.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric

from conveyor.engine.outputs import MetricName
from conveyor.entrypoints.metrics import EngineMetrics

TOTAL_REPLICA = "all"
REPLICA_RESTARTS = "conveyor:replica_restarts"  # rendered with Prometheus' _total suffix
_MEAN_GAUGES = {MetricName.KV_CACHE_USAGE_PERC}


class DataParallelMetrics:
    """Args:
    model_name: the `model_name` label value.
    log_interval_s: seconds between each replica's stats log lines (<= 0: none).
    num_replicas: how many replicas report.
    """

    def __init__(self, model_name: str, log_interval_s: float, num_replicas: int) -> None:
        self.replicas = [
            EngineMetrics(model_name, log_interval_s, replica=i) for i in range(num_replicas)
        ]
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self._restarts = Counter(
            REPLICA_RESTARTS,
            "Restarts of a data-parallel replica whose engine died.",
            ["model_name", "replica"],
            registry=self.registry,
        )
        for i in range(num_replicas):  # every replica's series from the start, at 0
            self._restarts.labels(model_name, str(i))
        self._model_name = model_name

    def record_replica_restart(self, replica: int) -> None:
        """Replica `replica` died and is being restarted."""
        self._restarts.labels(self._model_name, str(replica)).inc()

    def collect(self) -> Iterator[Metric]:
        """Every replica family once: each replica's samples, then the totals (the registry
        calls this to render; the restart counter renders itself)."""
        families: dict[str, Metric] = {}
        totals: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for metrics in self.replicas:
            for family in metrics.registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                    totals[family.name] = {}
                for sample in family.samples:
                    merged.add_sample(sample.name, sample.labels, sample.value, sample.timestamp)
                    if sample.name.endswith("_created"):  # a timestamp: no total
                        continue
                    labels = {**sample.labels, "replica": TOTAL_REPLICA}
                    key = (sample.name, tuple(sorted(labels.items())))
                    sums = totals[family.name]
                    sums[key] = sums.get(key, 0.0) + sample.value
        for name, merged in families.items():
            mean = name in _MEAN_GAUGES
            for (sample_name, labels), value in totals[name].items():
                value = value / len(self.replicas) if mean else value
                merged.add_sample(sample_name, dict(labels), value)
            yield merged

    def maybe_log(self, now: float) -> None:
        """Each replica's stats line, when its interval has passed."""
        for metrics in self.replicas:
            metrics.maybe_log(now)

    def render(self) -> bytes:
        """All replicas' series and the totals, in Prometheus' text exposition format."""
        return generate_latest(self.registry)
