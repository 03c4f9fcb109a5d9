"""core/limits.py: one rule for what a prompt must fit, one message per failure."""

from __future__ import annotations

import pickle

import pytest

from conveyor.config import EngineConfig
from conveyor.core.limits import PromptError, PromptLimits, check_kv_fits
from conveyor.core.scheduler import Scheduler
from conveyor.core.sequence import Sequence
from conveyor.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams

LIMITS = PromptLimits(max_model_len=64, vocab_size=100, kv_capacity=128)


def _error(fn, *args, **kwargs) -> PromptError:
    with pytest.raises(PromptError) as info:
        fn(*args, **kwargs)
    return info.value


def test_max_tokens_is_clamped_to_the_context_unless_strict() -> None:
    assert LIMITS.check([1] * 10, SamplingParams(max_tokens=40)) == 40
    assert LIMITS.check([1] * 10, SamplingParams(max_tokens=None)) == 54
    assert LIMITS.check([1] * 10, SamplingParams(max_tokens=60)) == 54
    assert LIMITS.check([1] * 10, SamplingParams(max_tokens=54), strict=True) == 54
    assert LIMITS.check([1] * 10, SamplingParams(max_tokens=None), strict=True) == 54


def test_strict_refuses_a_max_tokens_beyond_the_context_naming_max_tokens() -> None:
    error = _error(LIMITS.check, [1] * 10, SamplingParams(max_tokens=60), strict=True)
    assert error.param == "max_tokens"
    assert str(error) == (
        "This model's maximum context length is 64 tokens. However, you requested 70 tokens "
        "(10 in the prompt, 60 in the completion). Please reduce the length of the prompt or "
        "completion."
    )


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([], "at least one token"),
        ([1, 100], r"in \[0, 100\); got 100"),
        ([1, True], "got True"),
        ([1] * 64, "maximum context length is 64 tokens.*your prompt has 64 tokens"),
    ],
)
def test_prompts_that_can_never_run_blame_the_prompt(ids, match) -> None:
    error = _error(LIMITS.check, ids, SamplingParams(max_tokens=1), strict=True)
    assert error.param == "prompt"
    assert _error(LIMITS.check, ids, SamplingParams(max_tokens=1)).args == error.args
    with pytest.raises(ValueError, match=match):
        raise error


def test_the_scheduler_and_prompt_limits_give_one_kv_message() -> None:
    limits = PromptLimits(max_model_len=64, vocab_size=100, kv_capacity=48)
    config = EngineConfig(block_size=8, num_kv_blocks=6, max_model_len=64)  # 48 slots too
    prompt = list(range(1, 31))
    params = SamplingParams(max_tokens=20)
    from_limits = _error(limits.check, prompt, params)
    from_scheduler = _error(Scheduler(config).add_request, Sequence("r", prompt, params, 20))
    assert (
        str(from_limits)
        == str(from_scheduler)
        == (
            "The request needs 49 KV cache slots (prompt 30 + max_tokens 20 - 1) but the whole "
            "KV cache holds 48; lower max_tokens or the prompt length, or give the engine more "
            "KV blocks."
        )
    )
    check_kv_fits(30, 19, 48)  # exactly full fits
    assert str(_error(check_kv_fits, 0, 5, 48)) == str(_error(limits.check, [], params))


def test_prompt_error_survives_pickling() -> None:
    # An engine process sends exceptions back over a pipe.
    error = pickle.loads(pickle.dumps(PromptError("too long", param="max_tokens")))
    assert isinstance(error, ValueError) and error.param == "max_tokens"
    assert str(error) == "too long"


def test_stop_token_ids_are_bounded_and_inside_the_vocabulary() -> None:
    # A million out-of-vocabulary ids with n=16 took 30 s and slowed every other stream
    # (issue 27 item 5): at most MAX_STOP_TOKEN_IDS, counted before anything is copied.
    with pytest.raises(ValueError, match=f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS}"):
        SamplingParams(stop_token_ids=range(10**6))
    SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    error = _error(LIMITS.check, [1, 2], SamplingParams(stop_token_ids=[5, 100]))
    assert error.param == "stop_token_ids"
    assert str(error) == "stop_token_ids must be token ids in [0, 100); got 100."
    assert LIMITS.check([1, 2], SamplingParams(stop_token_ids=[0, 99], max_tokens=3)) == 3
