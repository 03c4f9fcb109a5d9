"""Embeddings from the rows of a prompt's own forward: last-token or mean pooling.

An embedding request is a prompt run in chunks like any prefill, never sampled. Each step
hands the pooler the rows its chunk produced (final hidden states, after the final norm):

    prompt (P tokens) in chunks:    [0, c1)        [c1, c2)        [c2, P)
    last:                           -              -               row of P - 1
    mean:                           sum rows       + sum rows      + sum rows, / P

Mean sums are kept here, per request id, in float32, and dropped when the request finishes
or is aborted (`remove`); a preempted request recomputes from position 0, which starts its
sum afresh. A finished vector is cut to `dimensions` and then L2-normalized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.core.sequence import Sequence

# (request, first row of its chunk in the batch, rows in the chunk, chunk's first position)
PoolRows = tuple[Sequence, int, int, int]


class Pooler:
    """Per-request mean sums and the pooling of each step's rows."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def remove(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sums.pop(rid, None)

    def __call__(self, hidden: torch.Tensor, groups: list[PoolRows]) -> dict[str, list[float]]:
        """Pool this step's chunks of embedding requests.

        Args:
            hidden: the step's [T, H] final hidden states.
            groups: the embedding requests' chunks in this step (their pooling type resolved).
        Returns:
            request id -> its embedding, for the requests whose prompt ended in this step.
        """
        done: dict[str, torch.Tensor] = {}
        for req, row0, count, start in groups:
            rid = req.request_id
            pooling = req.sampling_params.pooling
            assert pooling is not None and pooling.pooling_type is not None
            end = start + count
            finished = end == req.num_prompt_tokens
            if pooling.pooling_type == "mean":
                chunk = hidden[row0 : row0 + count].float().sum(dim=0)
                if start == 0:
                    self._sums[rid] = chunk
                else:  # mean pooling never takes prefix-cache hits: its sum was started
                    self._sums[rid] += chunk
                if finished:
                    done[rid] = self._sums.pop(rid) / req.num_prompt_tokens
            elif finished:
                done[rid] = hidden[row0 + count - 1].float()
        out: dict[str, list[float]] = {}
        for req, *_ in groups:
            vec = done.get(req.request_id)
            if vec is None:
                continue
            pooling = req.sampling_params.pooling
            if pooling.dimensions is not None:  # type: ignore[union-attr]
                vec = vec[: pooling.dimensions]  # type: ignore[union-attr]
            if pooling.normalize:  # type: ignore[union-attr]
                vec = F.normalize(vec, p=2.0, dim=0)
            out[req.request_id] = vec.cpu().tolist()
        return out
