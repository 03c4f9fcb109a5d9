"""The tenant rule of the scheduler (`TenantShares`): tenants share each step's time.

Rows in one step share its time. Where a row costs about as much as the step's fixed part (a
small model on a CPU, compute-bound from a few rows, dearer still with logprobs), one tenant
decoding 16 samples makes every step of another tenant's single request many times longer.
So while requests of two or more tenants (`SamplingParams.tenant`) have work, each step is
sized for the lightest one (the fewest requests in the step, then the fewest tokens):

    the lightest tenant        all it has
    each other tenant's        as many as the lightest has requests (tenants alike, such as
    decode rows                many clients of one stream each, are never held back), and
                               beyond that, all of them together, the rows that take about
                               SHARE of the time the lightest's step takes alone, saved up
                               over steps when that is under one row (so the excess may sit
                               some steps out, never for good), split evenly among them in
                               turn, each tenant's requests taking their turns in rotation
    prompt tokens              as without tenants: a short prompt whole, a long one by the
                               long-prefill rule (core/long_prefills.py), so a new client's
                               first token is not held back

The times are measured on the scheduler's clock: over the shared steps in which the lightest
tenant only decoded, a least-squares line of the step's time against the number of the
others' rows in it (`RowCost`) gives the lightest's step alone (its intercept) and the cost of
one such row (its slope), whatever else a step at one point of a request's life costs. So on a
GPU or a memory-bound model, where a row costs next to nothing, the others lose next to
nothing. At least one shared step in PROBE_EVERY gives the others their base rows only, so
the line sees steps of different sizes; until it is known they get one row a step beyond it.

A client sending one request after another leaves a short gap between them. A tenant whose
running requests just ended stays in the share (as if it had one request of one token) for
about as long as most recent such gaps took (GRACE_STEPS of its steps until gaps were seen),
and while only one other tenant has work the engine loop waits that long for its next
request (`hold_s`), if that is shorter than the others' step it puts off, which the
returning request would otherwise wait for. With one tenant (every request of an `LLM` unless
`tenant=` says otherwise, a server's one client) nothing changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.core.sequence import Sequence


class RowCost:
    """A step's seconds as `alone + per_row * rows`, a least-squares line over the recent
    shared steps (older ones weigh less: DECAY per step)."""

    DECAY = 0.97
    _MIN_WEIGHT = 4.0  # about this many steps observed before the line is used

    __slots__ = ("_w", "_x", "_xx", "_xy", "_y")

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(seconds alone, seconds per row), or None while the steps seen cannot tell them
        apart (too few, all with as many rows, or a line that says rows cost nothing)."""
        w = self._w
        if w < self._MIN_WEIGHT:
            return None
        mx, my = self._x / w, self._y / w
        var = self._xx / w - mx * mx
        if var <= 1e-6:
            return None
        per_row = (self._xy / w - mx * my) / var
        if per_row <= 0.0:
            return None
        return max(my - per_row * mx, 0.0), per_row


class TenantShares:
    """The tenant rule of one scheduler (see the module docstring), and what it remembers
    between steps: the step times it measured, the other tenants' saved-up rows, whose turn
    it is and who is in their grace steps."""

    SHARE = 0.5  # the others' time beside the lightest tenant, over that tenant's step time
    GRACE_STEPS = 2
    # Gaps between a tenant's work ending and its next request kept, the share of them a
    # grace covers, and a margin (an arrival is stamped a little before the engine sees it).
    GAP_SAMPLES = 16
    GAP_QUANTILE = 0.8
    GAP_MARGIN_S = 0.002
    ENDED_KEPT = 4096
    WAITING_LOOKED_AT = 8  # waiting requests counted as work (those admitted soonest)
    # At least one shared step in this many of the lightest's decodes is its alone, so its
    # time stays measured as it changes.
    PROBE_EVERY = 8

    __slots__ = (
        "_base", "_decode_only", "_ended", "_gaps", "_grace", "_pending", "_rows", "_shared",
        "_since_probe", "_tenant_turn", "_turn", "cost", "credit",
    )  # fmt: skip

    def __init__(self) -> None:
        self.cost = RowCost()  # the lightest's decode steps against the others' rows
        self.credit = 0.0  # the others' rows saved up
        self._shared = False  # whether the previous step was sized for the lightest ...
        self._decode_only = False  # ... whose work in it was decode rows only ...
        self._rows = 0  # ... beside that many of the other tenants' rows ...
        self._base = 0  # ... of which the others' base rows
        self._since_probe = 0  # shared steps since the lightest last ran alone
        self._grace: dict[str, float] = {}  # tenant -> until when it stays in the share
        self._ended: dict[str, float] = {}  # tenant -> when its work last ended
        self._pending: set[str] = set()  # tenants whose work ended, not yet stamped
        self._gaps: deque[float] = deque(maxlen=self.GAP_SAMPLES)
        self._turn: dict[str, int] = {}  # tenant -> where its next rotation starts
        self._tenant_turn = 0  # which of the other tenants gets a row left over first

    def observe(self, seconds: float) -> None:
        """The previous step took `seconds` (back to back with this one)."""
        if self._shared and self._decode_only:
            self.cost.observe(self._rows, seconds)

    def grace_s(self) -> float:
        """How long a tenant whose work ended stays in the share: the time most of the
        recent gaps between a tenant's work ending and its next request took (a high
        quantile: most returning clients, not the slowest), else GRACE_STEPS of the
        lightest's steps alone (0 while neither is known)."""
        if len(self._gaps) >= self.GAP_SAMPLES // 4:
            ranked = sorted(self._gaps)
            return ranked[int(self.GAP_QUANTILE * (len(ranked) - 1))] + self.GAP_MARGIN_S
        fit = self.cost.fit()
        return 0.0 if fit is None else self.GRACE_STEPS * fit[0]

    def arrived(self, tenant: str, arrival_time: float) -> None:
        """A request of `tenant` arrived at `arrival_time`: if that tenant's work had ended,
        the gap is a sample for grace_s."""
        self._pending.discard(tenant)
        self._grace.pop(tenant, None)
        ended = self._ended.pop(tenant, None)
        if ended is not None:
            self._gaps.append(max(0.0, arrival_time - ended))

    def ended(self, tenant: str) -> None:
        """`tenant`'s last unfinished request finished: its grace time starts at the next
        clock reading (`stamp`), when the step that finished it has ended."""
        self._pending.add(tenant)

    def stamp(self, now: float) -> None:
        """The scheduler's clock read `now`: the tenants that just ended enter their grace."""
        if not self._pending:
            return
        until = now + self.grace_s()
        for t in self._pending:
            self._grace[t] = until
            self._ended[t] = now
        self._pending.clear()
        while len(self._ended) > self.ENDED_KEPT:  # tenants gone for good: oldest first
            del self._ended[next(iter(self._ended))]

    def in_grace(self) -> bool:
        """Whether a tenant is (or is about to be) in its grace time."""
        return bool(self._grace) or bool(self._pending)

    def demands(
        self, running: Iterable[tuple[Sequence, int]], waiting: Iterable[Sequence], now: float
    ) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        """Each tenant's (requests, tokens) and decode rows this step, from the running
        requests' `(request, tokens left)` and the `waiting` requests that could be admitted
        now; a tenant in its grace time (its running requests ended at most grace_s ago)
        counts one request of one token."""
        work: dict[str, tuple[int, int]] = {}
        rows: dict[str, int] = {}
        for req, n in running:
            if n > 0:
                t = req.tenant
                count, tokens = work.get(t, (0, 0))
                work[t] = (count + 1, tokens + n)
                if req.num_computed_tokens >= req.num_prompt_tokens:
                    rows[t] = rows.get(t, 0) + 1
        for req in waiting:
            t = req.tenant
            count, tokens = work.get(t, (0, 0))
            work[t] = (count + 1, tokens + max(1, req.num_tokens - req.num_computed_tokens))
        self.stamp(now)
        for t, until in list(self._grace.items()):
            if until <= now:
                del self._grace[t]
            elif t not in work:
                work[t] = (1, 1)
        if len(work) < 2:
            self._turn.clear()
            self.credit = 0.0
        return work, rows

    def hold_s(self, now: float, tenants: Iterable[str], requests: int) -> float:
        """Seconds to wait for a request before the next step, whose work is `requests`
        requests of `tenants` (those with unfinished requests): while one tenant has work
        and another is in its grace time, the rest of that time, if shorter than the step it
        puts off (0: do not wait)."""
        self.stamp(now)
        tenants = set(tenants)
        if len(tenants) != 1:
            return 0.0
        waits = [until - now for t, until in self._grace.items() if t not in tenants]
        hold = max(0.0, max(waits, default=0.0))
        fit = self.cost.fit()
        if hold and fit is not None and hold >= fit[0] + fit[1] * requests:
            return 0.0
        return hold

    def allowances(
        self, work: dict[str, tuple[int, int]], rows: dict[str, int]
    ) -> dict[str, int] | None:
        """The decode rows each tenant but the lightest (the fewest requests, then tokens)
        may take this step (None: one tenant, no limit), from `demands`; the caller then
        `spend`s what they took."""
        self._shared = len(work) >= 2
        if not self._shared:
            return None
        lightest = min(work, key=work.__getitem__)
        self._decode_only = rows.get(lightest, 0) == work[lightest][1]
        others = sorted(t for t in rows if t != lightest)
        # Each other tenant may always run as many rows as the lightest has requests: tenants
        # alike (many clients of one stream each) are never held back, only the excess.
        base = {t: min(rows[t], work[lightest][0]) for t in others}
        self._base = sum(base.values())
        beyond = sum(rows[t] for t in others) - self._base
        fit = self.cost.fit()
        if self._decode_only and self._since_probe >= self.PROBE_EVERY:
            self._since_probe = 0  # this step times the lightest with the fewest rows
            return base
        # The others' rows the share pays for, beyond their base (until the line is known:
        # one a step).
        rate = 1.0 if fit is None else self.SHARE * fit[0] / fit[1] - self._base
        self.credit = min(self.credit + max(0.0, rate), float(max(1, beyond)))
        left = int(self.credit)
        allow = base
        # Split evenly, the rows left over going round the tenants in turn.
        start = self._tenant_turn
        self._tenant_turn += 1
        while left > 0:
            open_ = [t for t in others if allow[t] < rows[t]]
            if not open_:
                break
            each, extra = divmod(left, len(open_))
            for i, t in enumerate(open_):
                give = min(rows[t] - allow[t], each + ((i - start) % len(open_) < extra))
                allow[t] += give
                left -= give
        return allow

    def spend(self, rows: int) -> None:
        """The other tenants took `rows` decode rows this step (0 without tenants' shares)."""
        self.credit = max(0.0, self.credit - max(0, rows - self._base))
        self._rows = rows
        if self._shared and self._decode_only:  # (one with the base rows only is a probe)
            self._since_probe = self._since_probe + 1 if rows > self._base else 0

    def rotate(self, tenant: str, reqs: list[Sequence], allowance: int) -> list[Sequence]:
        """`reqs` (one tenant's running requests, in running order) from where its rotation
        stands, which then moves on by `allowance` requests."""
        if not reqs or allowance <= 0:
            return reqs
        start = self._turn.get(tenant, 0) % len(reqs)
        self._turn[tenant] = start + allowance
        return reqs[start:] + reqs[:start]
