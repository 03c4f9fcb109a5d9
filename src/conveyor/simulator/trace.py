"""Request traces for the simulator: one row per request, from a file or a named distribution.

A trace row is what scheduling needs and nothing else: when the request arrives, how long its
prompt is and how many tokens it will generate (plus optional priority, deadline, length hint
and an output cap the scheduler sees instead of the true length).

Files (`load_trace`): JSON, either a list of objects or {"requests": [...]}, or CSV with a
header row; the field names are TraceRequest's (`arrival_time`, `prompt_len`, `output_len`
are required, empty CSV cells take the defaults):

    arrival_time,prompt_len,output_len,priority,deadline
    0.0,32,10,0,
    0.1,48,200,1,5.0

Named workloads (`synthetic_trace`): output lengths from `exponential` (chat-like traffic),
`uniform` (between half and one and a half times the mean: similar lengths, where continuous
batching gains little), `lognormal`, `bimodal` (80 % short, 20 % long) or `fixed`
distributions, prompt lengths uniform, arrivals all at t = 0 (rate = inf) or a
Poisson process; `guide-static` and `guide-continuous` are the two worked examples of
docs/scheduling.md.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.validation import check_int, check_number, check_positive_int

WORKLOADS = ("exponential", "uniform", "lognormal", "bimodal", "fixed")
GUIDE_WORKLOADS = ("guide-static", "guide-continuous")


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace.

    Args:
        arrival_time: seconds from the start of the trace.
        prompt_len: prompt tokens.
        output_len: tokens the request really generates before it stops.
        max_tokens: the cap the scheduler sees (SJF ranks by it); default `output_len`.
            A larger cap models requests that stop early at eos.
        priority: lower runs first under the `priority` scheduler.
        deadline: seconds from arrival after which the request is aborted.
        length_hint: the expected output length given to the SJF family.
        request_id: defaults to the row index.
    """

    arrival_time: float
    prompt_len: int
    output_len: int
    max_tokens: int | None = None
    priority: int = 0
    deadline: float | None = None
    length_hint: int | None = None
    request_id: str | None = None

    def __post_init__(self) -> None:
        check_number(
            "arrival_time", self.arrival_time, ">= 0 and finite", lambda v: 0 <= v < math.inf
        )
        check_positive_int("prompt_len", self.prompt_len)
        check_positive_int("output_len", self.output_len)
        if self.max_tokens is None:
            self.max_tokens = self.output_len
        else:
            check_int("max_tokens", self.max_tokens, lo=self.output_len, hint="output_len")


_FIELDS = {f.name: f for f in dataclasses.fields(TraceRequest)}
_INT_FIELDS = ("prompt_len", "output_len", "max_tokens", "priority", "length_hint")


def _row_to_request(row: dict[str, Any], where: str) -> TraceRequest:
    unknown = set(row) - set(_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(_FIELDS)}.")
    missing = {"arrival_time", "prompt_len", "output_len"} - set(row)
    if missing:
        raise ValueError(f"{where}: missing field(s) {sorted(missing)}.")
    try:
        return TraceRequest(**row)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _parse_csv_cell(name: str, cell: str) -> Any:
    if name == "request_id":
        return cell
    try:
        return int(cell) if name in _INT_FIELDS else float(cell)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {cell!r}.") from None


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSON or CSV trace (by file suffix), sorted by arrival time.

    Raises:
        ValueError: an unknown suffix, a malformed file, or a row with missing, unknown or
            invalid fields (the message names the row).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    rows: list[dict[str, Any]]
    if suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc}).") from None
        if isinstance(data, dict):
            data = data.get("requests")
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise ValueError(f"{path}: expected a list of objects or {{'requests': [...]}}.")
        rows = data
    elif suffix == ".csv":
        with path.open(newline="") as f:
            rows = []
            for i, raw in enumerate(csv.DictReader(f)):
                row = {}
                for k, v in raw.items():
                    if k is None or v is None or v.strip() == "":
                        continue
                    try:
                        row[k.strip()] = _parse_csv_cell(k.strip(), v.strip())
                    except ValueError as exc:
                        raise ValueError(f"{path} row {i + 1}: {exc}") from None
                rows.append(row)
    else:
        raise ValueError(f"{path}: a trace must be a .json or .csv file.")
    trace = [_row_to_request(r, f"{path} row {i + 1}") for i, r in enumerate(rows)]
    if not trace:
        raise ValueError(f"{path}: the trace has no requests.")
    return sorted(trace, key=lambda r: r.arrival_time)


def guide_trace(name: str) -> list[TraceRequest]:
    """docs/scheduling.md's worked examples, in units of one step (simulate them at 1 s a step).

    `guide-static`: four requests of 10, 5, 8 and 12 tokens at t = 0. `guide-continuous`: the
    same four, then 6 tokens arriving at t = 2 and 7 at t = 3 (waiting from steps 3 and 4).
    Prompts are 4 tokens, computed in each request's first step.
    """
    lengths = [(0.0, 10), (0.0, 5), (0.0, 8), (0.0, 12)]
    if name == "guide-continuous":
        lengths += [(2.0, 6), (3.0, 7)]
    elif name != "guide-static":
        raise ValueError(f"unknown guide example {name!r}; choose one of {GUIDE_WORKLOADS}.")
    return [TraceRequest(t, 4, n, request_id=f"R{i + 1}") for i, (t, n) in enumerate(lengths)]


def synthetic_trace(
    workload: str,
    num_requests: int = 1000,
    *,
    rate: float = math.inf,
    prompt_len: tuple[int, int] = (16, 128),
    mean_output: float = 64.0,
    max_output: int = 1024,
    seed: int = 0,
) -> list[TraceRequest]:
    """A seeded synthetic trace (or a docs/scheduling.md example; then the rest is ignored).

    Args:
        workload: one of WORKLOADS or GUIDE_WORKLOADS.
        num_requests: how many requests.
        rate: mean arrivals per second (a Poisson process); inf puts every arrival at t = 0.
        prompt_len: (min, max) prompt tokens, uniform.
        mean_output: mean output tokens before clipping to [1, max_output].
        max_output: the largest output length.
        seed: the random seed; the same arguments give the same trace.
    Returns:
        The requests, sorted by arrival time.
    """
    if workload in GUIDE_WORKLOADS:
        return guide_trace(workload)
    if workload not in WORKLOADS:
        names = ", ".join(WORKLOADS + GUIDE_WORKLOADS)
        raise ValueError(f"unknown workload {workload!r}; choose one of {names}.")
    check_positive_int("num_requests", num_requests)
    lo, hi = prompt_len
    if not 1 <= lo <= hi:
        raise ValueError(f"prompt_len must be (min, max) with 1 <= min <= max, got {prompt_len}.")
    check_number("rate", rate, "> 0 (inf: all at once)", lambda v: v > 0)
    if not 1 <= mean_output <= max_output:
        raise ValueError(f"need 1 <= mean_output <= max_output, got {mean_output}, {max_output}.")
    rng = random.Random(seed)
    draw = {
        "exponential": lambda: math.ceil(rng.expovariate(1.0 / mean_output)),
        "uniform": lambda: rng.randint(max(1, round(mean_output / 2)), round(1.5 * mean_output)),
        # sigma = 1; mu chosen so that the mean is mean_output.
        "lognormal": lambda: round(rng.lognormvariate(math.log(mean_output) - 0.5, 1.0)),
        "bimodal": lambda: math.ceil(
            rng.expovariate(1.0 / (mean_output * (0.25 if rng.random() < 0.8 else 4.0)))
        ),
        "fixed": lambda: round(mean_output),
    }[workload]
    t = 0.0
    trace = []
    for i in range(num_requests):
        if rate != math.inf and i > 0:
            t += rng.expovariate(rate)
        out = min(max(1, draw()), max_output)
        trace.append(TraceRequest(t, rng.randint(lo, hi), out, request_id=str(i)))
    return trace
