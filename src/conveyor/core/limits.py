"""What a prompt must fit, checked in one place with one message per failure.

`PromptLimits.check` is the whole rule: a non-empty prompt of valid token ids that leaves room
for output in the model's context and fits, with its output, in the whole KV cache (an
embedding request, which samples nothing, may fill the whole context).
`LLMEngine`, `LLM` and `AsyncLLM` call it before queueing; the HTTP server calls it with
`strict=True` and turns the error into a 400 naming `PromptError.param`. The scheduler calls
`check_kv_fits`, the part it can judge from a Sequence alone: a request that never fits the
cache would wait forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.sampling_params import SamplingParams

EMPTY_PROMPT = "The prompt is empty: give at least one token."


class PromptError(ValueError):
    """A prompt that can never run.

    `param` is the request field at fault: "prompt", "max_tokens" / "min_tokens" (a strict
    check's output bounds beyond the context), "logit_bias", "allowed_token_ids" or
    "stop_token_ids". It has a default so the error survives pickling.
    """

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


def check_kv_fits(num_prompt_tokens: int, max_tokens: int, kv_capacity: int) -> None:
    """Raise unless a non-empty prompt and its output fit in the whole KV cache.

    Args:
        num_prompt_tokens: prompt length.
        max_tokens: the output cap, already clamped to the model's context.
        kv_capacity: KV slots in the whole cache (num_kv_blocks * block_size).
    Raises:
        PromptError: an empty prompt, or more slots than the whole cache holds.
    """
    if num_prompt_tokens == 0:
        raise PromptError(EMPTY_PROMPT)
    # The last sampled token is never fed back, so a sequence holds n + max_tokens - 1 slots.
    # Slots, not blocks: ceil(need / block_size) > num_blocks iff need > kv_capacity.
    need = num_prompt_tokens + max_tokens - 1
    if need > kv_capacity:
        raise PromptError(
            f"The request needs {need} KV cache slots (prompt {num_prompt_tokens} + max_tokens "
            f"{max_tokens} - 1) but the whole KV cache holds {kv_capacity}; lower "
            "max_tokens or the prompt length, or give the engine more KV blocks."
        )


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What a prompt must fit: the model's context, its vocabulary, the whole KV cache.

    Plain numbers, so a process without the engine (the HTTP side of an engine process) can
    check prompts before it queues them.
    """

    max_model_len: int
    vocab_size: int
    kv_capacity: int  # KV slots in the whole cache: num_kv_blocks * block_size

    def check(self, prompt_ids: list[int], params: SamplingParams, strict: bool = False) -> int:
        """Reject a prompt that can never run; return its output cap.

        Args:
            prompt_ids: the prompt.
            params: its sampling parameters (`max_tokens`, and `min_tokens` if strict).
            strict: a `max_tokens` or `min_tokens` beyond what the context leaves is an error
                (the OpenAI server's rule, as in vLLM) instead of being clamped.
        Returns:
            max_tokens clamped to what the model's context leaves after the prompt.
        Raises:
            PromptError: an empty prompt, a token id outside the vocabulary (in the prompt,
                logit_bias, allowed_token_ids or stop_token_ids), a prompt that
                leaves no room in the context, (strict) a max_tokens beyond the context, or a
                request larger than the whole KV cache.
        """
        if not prompt_ids:
            raise PromptError(EMPTY_PROMPT)
        vocab = self.vocab_size
        for t in prompt_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise PromptError(f"Prompt token ids must be integers in [0, {vocab}); got {t!r}.")
        for t in params.logit_bias or ():
            if t >= vocab:
                raise PromptError(
                    f"logit_bias keys must be token ids in [0, {vocab}); got {t}.", "logit_bias"
                )
        for t in params.allowed_token_ids or ():
            if t >= vocab:
                raise PromptError(
                    f"allowed_token_ids must be token ids in [0, {vocab}); got {t}.",
                    "allowed_token_ids",
                )
        for t in params.stop_token_ids:
            if t >= vocab:
                raise PromptError(
                    f"stop_token_ids must be token ids in [0, {vocab}); got {t}.",
                    "stop_token_ids",
                )
        n, limit = len(prompt_ids), self.max_model_len
        context = f"This model's maximum context length is {limit} tokens."
        if params.pooling is not None:  # an embedding: the prompt alone, nothing sampled
            if n > limit:
                raise PromptError(
                    f"{context} However, you requested {n} tokens in the input for embedding "
                    "generation. Please reduce the length of the input."
                )
            check_kv_fits(n, 1, self.kv_capacity)
            return 1
        if n >= limit:
            raise PromptError(
                f"{context} However, your prompt has {n} tokens, leaving no room for output."
            )
        room = limit - n
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if strict and params.max_tokens is not None and params.max_tokens > room:
            requested = params.max_tokens
            raise PromptError(
                f"{context} However, you requested {n + requested} tokens ({n} in the prompt, "
                f"{requested} in the completion). Please reduce the length of the prompt or "
                "completion.",
                param="max_tokens",
            )
        if strict and params.min_tokens > room:
            raise PromptError(
                f"{context} However, you requested min_tokens={params.min_tokens} with a "
                f"{n}-token prompt, which leaves room for {room}. Please reduce min_tokens or "
                "the length of the prompt.",
                param="min_tokens",
            )
        check_kv_fits(n, max_tokens, self.kv_capacity)
        return max_tokens
