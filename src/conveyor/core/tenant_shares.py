"""The tenant rule of the scheduler (`TenantShares`): tenants share each step's time.

Rows in one step share its time. Where a row costs about as much as the step's fixed part (a
small model on a CPU, compute-bound from a few rows), one tenant decoding 16 samples makes
every step of another tenant's single request many times longer. So while requests of two
or more tenants (`SamplingParams.tenant`) have work, each step is sized for the lightest one
(the fewest tokens this step, prompt tokens included):

    the lightest tenant        all it has
    each other tenant's        the decode rows that take about SHARE of the time a step of
    decode rows, together      the lightest's tokens takes alone, split evenly among them
                               (one needing fewer leaves the rest to the others), at least
                               one each, its requests taking their turns in rotation
    prompt tokens              as without tenants: a short prompt whole, a long one by the
                               long-prefill rule (core/long_prefills.py), so a new client's
                               first token is not held back

With a step's time fitted as `fixed + per_token * tokens` over recent steps (`StepCost`), the
others get `SHARE * (fixed / per_token + d)` rows for the lightest's d tokens: many on a GPU
or a memory-bound model (where a row costs next to nothing), few where rows are dear. Until
the fit is known they get `SHARE * d`.

A client sending one request after another leaves a short gap between them; a tenant whose
running requests just ended stays in the share for GRACE_STEPS steps (as if it had one
token), so its next request does not arrive during a step sized for the others alone. With
one tenant (every request of an `LLM` unless `tenant=` says otherwise, a server's one client)
nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.core.sequence import Sequence


class StepCost:
    """A step's seconds as `fixed + per_token * tokens`, a least-squares fit over the recent
    back-to-back steps (older ones weigh less: DECAY per step)."""

    DECAY = 0.98
    _MIN_WEIGHT = 4.0  # about this many steps observed before the fit is used

    __slots__ = ("_w", "_x", "_xx", "_xy", "_y")

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the steps seen cannot tell them
        apart (too few, all of one size, or a fit that says more tokens cost nothing)."""
        w = self._w
        if w < self._MIN_WEIGHT:
            return None
        mx, my = self._x / w, self._y / w
        var = self._xx / w - mx * mx
        if var <= 1e-6 * max(1.0, mx * mx):
            return None
        per_token = (self._xy / w - mx * my) / var
        if per_token <= 0.0:
            return None
        return max(0.0, my - per_token * mx), per_token


class TenantShares:
    """The tenant rule of one scheduler (see the module docstring)."""

    SHARE = 0.5  # the others' time beside the lightest tenant, over that tenant's step time
    GRACE_STEPS = 2
    WAITING_LOOKED_AT = 8  # waiting requests counted as work (those admitted soonest)

    __slots__ = ("_grace", "_turn", "cost")

    def __init__(self) -> None:
        self.cost = StepCost()
        self._grace: dict[str, int] = {}  # tenant -> steps it stays in the share
        self._turn: dict[str, int] = {}  # tenant -> where its next step's rotation starts

    def demands(
        self, running: Iterable[tuple[Sequence, int]], waiting: Iterable[Sequence]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Each tenant's tokens and decode rows this step, from the running requests'
        `(request, tokens left)` and the `waiting` requests that could be admitted now; a
        tenant whose running requests ended in the last GRACE_STEPS steps counts one token."""
        tokens: dict[str, int] = {}
        rows: dict[str, int] = {}
        for req, n in running:
            if n > 0:
                t = req.tenant
                tokens[t] = tokens.get(t, 0) + n
                if req.num_computed_tokens >= req.num_prompt_tokens:
                    rows[t] = rows.get(t, 0) + 1
        grace = self._grace
        for t in list(grace):
            if t in tokens:
                grace[t] = self.GRACE_STEPS
                continue
            left = grace.pop(t)
            if left > 0:
                tokens[t] = 1
                grace[t] = left - 1
        for t in tokens:
            grace.setdefault(t, self.GRACE_STEPS)
        for req in waiting:
            t = req.tenant
            tokens[t] = tokens.get(t, 0) + max(1, req.num_tokens - req.num_computed_tokens)
        if len(tokens) < 2:
            self._turn.clear()
        return tokens, rows

    def allowances(self, tokens: dict[str, int], rows: dict[str, int]) -> dict[str, int] | None:
        """The decode rows each tenant but the lightest may take this step (None: one tenant,
        no limit), from `demands`."""
        if len(tokens) < 2:
            return None
        lightest = min(tokens, key=tokens.__getitem__)
        fit = self.cost.fit()
        ratio = 0.0 if fit is None else fit[0] / fit[1]  # the fixed part, in tokens
        rest = self.SHARE * (ratio + tokens[lightest])
        others = sorted((t for t in rows if t != lightest), key=rows.__getitem__)
        allow: dict[str, int] = {}
        for i, t in enumerate(others):
            give = max(1, min(rows[t], int(rest / (len(others) - i))))
            allow[t] = give
            rest = max(0.0, rest - give)
        return allow

    def rotate(self, tenant: str, reqs: list[Sequence], allowance: int) -> list[Sequence]:
        """`reqs` (one tenant's running requests, in running order) from where its rotation
        stands, which then moves on by `allowance` requests."""
        if not reqs:
            return reqs
        start = self._turn.get(tenant, 0) % len(reqs)
        self._turn[tenant] = start + max(1, allowance)
        return reqs[start:] + reqs[:start]
