"""The trace simulator: the real scheduler and KV block manager, a step-cost model in place of
the model (no weights, no torch).

    trace.py    traces: JSON / CSV files, synthetic workloads, docs/scheduling.md's examples
    loop.py     simulate(): the clock, arrivals, schedule, cost, update
    summary.py  SimulationResult, its summary and the table `conveyor simulate` prints
"""

from __future__ import annotations

from conveyor.simulator.loop import StepCost, simulate
from conveyor.simulator.summary import (
    RequestTimeline,
    SimulationResult,
    format_table,
    percentile,
)

__all__ = [
    "RequestTimeline",
    "SimulationResult",
    "StepCost",
    "format_table",
    "percentile",
    "simulate",
]
