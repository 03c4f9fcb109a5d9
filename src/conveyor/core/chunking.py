"""How many of a request's tokens one step computes: what is left, within the step's budget,
and for a request with prompt logprobs at most PROMPT_LOGPROBS_CHUNK prompt tokens.

Every prompt row of a request with `prompt_logprobs` becomes a row of vocabulary-wide logits
(log_softmax, rank, top-k) in the step that computes it. A 1,900-token prompt on a 49k-token
vocabulary is ~370 MB of logits and seconds of work in one step, and every other request's
next token waits for that step. Chunking that prompt bounds the extra work per step; the
budget it leaves goes to the other requests as usual.

    prompt (P tokens), prompt_logprobs set       step 1      step 2      ...   last chunk
    computed tokens                             [0, 256)    [256, 512)       [.., P)

Long prefills (more than `long_prefill_token_threshold` tokens left) share a step with the
rest by measured times: core/long_prefills.py.
"""

from __future__ import annotations

from conveyor.core.sequence import Sequence

# Prompt tokens (logits rows) a request with prompt_logprobs computes per step.
PROMPT_LOGPROBS_CHUNK = 256


def num_tokens_to_schedule(req: Sequence, num_computed: int, budget: int) -> int:
    """Tokens `req` computes next, given `num_computed` already cached and `budget` left.

    Args:
        req: the request.
        num_computed: its tokens whose K/V are (or, with prefix-cache hits, will be) cached.
        budget: tokens the step can still hand out.
    Returns:
        min(tokens left, budget), capped at PROMPT_LOGPROBS_CHUNK while a request with
        prompt_logprobs still has prompt rows to compute (the row of its last prompt token
        predicts the first output: that one is the sampler's).
    """
    # (Called for every running request every step: lens and comparisons, no properties.)
    num_prompt = len(req.prompt_token_ids)
    n = num_prompt + len(req.output_token_ids) - num_computed
    if n > budget:
        n = budget
    if (
        n > PROMPT_LOGPROBS_CHUNK
        and num_computed < num_prompt - 1
        and req.sampling_params.prompt_logprobs is not None
    ):
        n = PROMPT_LOGPROBS_CHUNK
    return n


def is_partial(req: Sequence, num_scheduled: int) -> bool:
    """Whether `req`'s prompt (or recompute) is still unfinished after a step that computes
    `num_scheduled` of its tokens: more than the one token a decode step computes is left."""
    left = len(req.prompt_token_ids) + len(req.output_token_ids) - req.num_computed_tokens
    return left - num_scheduled > 1
