"""FiniteLogitsGuard: a request whose logits are not finite fails alone, not with its batch.

Wraps the model runner's sampler. One pass over the logits finds the rows holding NaN or ±inf
(CpuKernels.nonfinite_rows on CPU, a C loop; torch's isfinite elsewhere): a numerical fault of
that request. Those rows are sampled from zeros instead, so the sampler's arithmetic stays
defined for the rest of the batch, and their token becomes INVALID_TOKEN, which the engine
turns into a failure of that one request. The healthy rows' tokens are exactly what the
sampler alone would give. The model runner builds its sampler wrapped in this guard.

On a GPU, reading the bad rows before sampling would wait for the whole forward, so there the
masking is unconditional (rows that are not finite become zeros, on the device) and the list
of bad rows is read after the sampler's own copy to the host, when the GPU has nothing left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Never a vocabulary id: the engine fails the request that receives it.
INVALID_TOKEN = -1


class FiniteLogitsGuard:
    """Callable like the sampler it wraps; every other attribute is the sampler's."""

    def __init__(
        self, sampler: Any, nonfinite_rows: Callable[[torch.Tensor], list[int]] | None = None
    ) -> None:
        """`nonfinite_rows(logits)`: the rows holding a NaN or an infinity, in order (None:
        torch's isfinite)."""
        self.sampler = sampler
        self.nonfinite_rows = nonfinite_rows or _torch_nonfinite_rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def __call__(self, logits: torch.Tensor, requests: list[Any]) -> Any:
        """Sample like the wrapped sampler; rows with non-finite logits get INVALID_TOKEN.

        Args:
            logits: [N, V], row i belongs to requests[i]; not modified.
            requests: the N requests, in row order.
        """
        if logits.is_cuda:
            finite = torch.isfinite(logits).all(dim=-1)
            out = self.sampler(logits.masked_fill(~finite.unsqueeze(1), 0.0), requests)
            return _invalidate(out, [i for i, ok in enumerate(finite.tolist()) if not ok])
        bad = self.nonfinite_rows(logits)
        if not bad:
            return self.sampler(logits, requests)
        rows = torch.tensor(bad, device=logits.device)
        return _invalidate(self.sampler(logits.index_fill(0, rows, 0.0), requests), bad)


def _invalidate(out: Any, bad: list[int]) -> Any:
    for i in bad:
        out.token_ids[i] = INVALID_TOKEN
        out.logprobs[i] = None
    return out


def _torch_nonfinite_rows(logits: torch.Tensor) -> list[int]:
    return (~torch.isfinite(logits).all(dim=-1)).nonzero().flatten().tolist()
