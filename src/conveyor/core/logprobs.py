"""TokenLogprobs: what the sampler reports of one sampled position, in plain Python.

The sampler (model/) makes these and the engine's output state (engine/) turns them into the
user's logprob dicts; living here, below both, neither needs the other (nor torch) for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of one sampled position, from the raw model distribution."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token: how many tokens are at least as likely
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
