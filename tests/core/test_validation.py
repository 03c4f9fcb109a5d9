"""conveyor.validation: one message format, `{name} must be {rule}, got {value}.`"""

from __future__ import annotations

import math
import re

import pytest

from conveyor.config import EngineConfig
from conveyor.sampling_params import SamplingParams
from conveyor.server.config import ServerConfig
from conveyor.simulator.loop import StepCost
from conveyor.simulator.trace import TraceRequest
from conveyor.validation import check_choice, check_int, check_number, check_positive_int


def _message(check, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        check(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("x", "3"), {}, "x must be an integer, got '3'."),
        (("x", True), {}, "x must be an integer, got True."),
        (("x", 2.0), {}, "x must be an integer, got 2.0."),
        (("x", 0, 1), {}, "x must be >= 1, got 0."),
        (("x", 6, None, 5), {}, "x must be <= 5, got 6."),
        (("x", 6, 0, 5), {}, "x must be in [0, 5], got 6."),
        (("top_k", -2, -1), {"hint": "-1 disables"}, "top_k must be >= -1 (-1 disables), got -2."),
    ],
)
def test_check_int_rejects(args, kwargs, message) -> None:
    assert _message(check_int, *args, **kwargs) == message


def test_check_int_accepts_the_bounds() -> None:
    check_int("x", -(2**70))  # no bounds: any integer
    check_int("x", 0, 0, 5)
    check_int("x", 5, 0, 5)


@pytest.mark.parametrize("value", [0, -1, 1.0, True, "1", None])
def test_check_positive_int_rejects(value) -> None:
    expected = f"n must be a positive integer, got {value!r}."
    assert _message(check_positive_int, "n", value) == expected


def test_check_positive_int_accepts() -> None:
    check_positive_int("n", 1)
    check_positive_int("n", 10**9)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1", "p must be a number, got '1'."),
        (False, "p must be a number, got False."),
        (None, "p must be a number, got None."),
        (0, "p must be in (0, 1], got 0."),
        (1.5, "p must be in (0, 1], got 1.5."),
        (math.nan, "p must be in (0, 1], got nan."),
    ],
)
def test_check_number_rejects(value, message) -> None:
    assert _message(check_number, "p", value, "in (0, 1]", lambda v: 0 < v <= 1) == message


def test_check_number_never_passes_nan_even_when_the_rule_would() -> None:
    check_number("p", 0.5, "anything", lambda v: True)
    check_number("p", 3, "anything", lambda v: True)  # ints are numbers
    with pytest.raises(ValueError, match="p must be anything, got nan"):
        check_number("p", math.nan, "anything", lambda v: True)


def test_check_choice() -> None:
    check_choice("dtype", "auto", ("auto", "int8"))
    check_choice("block_size", 16, (8, 16))
    assert _message(check_choice, "dtype", "fp8", ("auto", "int8")) == (
        "dtype must be one of auto, int8; got 'fp8'."
    )
    assert _message(check_choice, "block_size", 12, (8, 16)) == (
        "block_size must be one of 8, 16; got 12."
    )


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: EngineConfig(max_num_seqs=0), "max_num_seqs"),
        (lambda: EngineConfig(block_size=12), "block_size"),
        (lambda: EngineConfig(kv_cache_space_gb="1"), "kv_cache_space_gb"),
        (lambda: EngineConfig(seed=1.5), "seed"),
        (lambda: EngineConfig(preemption_cooldown_s=math.inf), "preemption_cooldown_s"),
        (lambda: SamplingParams(top_p=0), "top_p"),
        (lambda: SamplingParams(n=True), "n"),
        (lambda: SamplingParams(stop_token_ids=[0] * 1025), "stop_token_ids"),
        (lambda: SamplingParams(cache_salt=""), "cache_salt"),
        (lambda: SamplingParams(cache_salt="s" * 1025), "cache_salt"),
        (lambda: SamplingParams(seed=-(2**63) - 1), "seed"),
        (lambda: ServerConfig(cache_salt_from="key"), "cache_salt_from"),
        (lambda: ServerConfig(port=70000), "port"),
        (lambda: ServerConfig(log_level="loud"), "log_level"),
        (lambda: ServerConfig(shutdown_timeout=-1), "shutdown_timeout"),
        (lambda: ServerConfig(max_n=0), "max_n"),
        (lambda: ServerConfig(request_timeout=math.inf), "request_timeout"),
        (lambda: TraceRequest(-1.0, 4, 2), "arrival_time"),
        (lambda: TraceRequest(0.0, 0, 2), "prompt_len"),
        (lambda: TraceRequest(0.0, 4, 5, max_tokens=3), "max_tokens"),
        (lambda: StepCost(base_s=math.nan), "base_s"),
    ],
)
def test_every_caller_uses_the_one_format(make, name) -> None:
    # The server reads the first word back as the 400's `param`.
    pattern = rf"{name} must be (.+)(, got |; got )(.+)\.$"
    with pytest.raises(ValueError) as info:
        make()
    assert re.match(pattern, str(info.value)), str(info.value)
