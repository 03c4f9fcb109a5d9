"""FiniteLogitsGuard: a request whose logits are not finite fails alone, not with its batch.

Wraps the model runner's sampler. One reduction per row finds the rows holding NaN or ±inf
(any such element makes the row's sum non-finite): a numerical fault of that request. Those
rows are sampled from zeros instead, so the sampler's arithmetic stays defined for the rest
of the batch, and their token becomes INVALID_TOKEN, which the engine turns into a failure of
that one request. The healthy rows' tokens are exactly what the sampler alone would give.
The model runner builds its sampler wrapped in this guard.
"""

from __future__ import annotations

from typing import Any

import torch

# Never a vocabulary id: the engine fails the request that receives it.
INVALID_TOKEN = -1


class FiniteLogitsGuard:
    """Callable like the sampler it wraps; every other attribute is the sampler's."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def __call__(self, logits: torch.Tensor, requests: list[Any]) -> Any:
        """Sample like the wrapped sampler; rows with non-finite logits get INVALID_TOKEN.

        Args:
            logits: [N, V], row i belongs to requests[i]; not modified.
            requests: the N requests, in row order.
        """
        finite = torch.isfinite(logits.sum(dim=-1))
        if bool(finite.all()):
            return self.sampler(logits, requests)
        bad = (~finite).nonzero().flatten().tolist()
        out = self.sampler(logits.masked_fill(~finite.unsqueeze(1), 0.0), requests)
        for i in bad:
            out.token_ids[i] = INVALID_TOKEN
            out.logprobs[i] = None
        return out
