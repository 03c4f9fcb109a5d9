"""The long-prefill rule of the scheduler (`LongPrefills`).

A request with more than `long_prefill_token_threshold` (T) tokens left to compute is a long
prefill, and stays one until its prompt is done (`is_long_prefill`: its last T tokens, deep
into its own long context, cost the most of all). On a CPU a step's time grows with its prompt
tokens (a prompt token deep into a long context can cost more than a whole decode step), so
one long prompt taking the whole budget stalls every decode and every short prompt for
seconds. Instead, in each step:

    the others (decodes, short prefills)   go first, as before
    long prefills, together                beside other work: the tokens that take about
                                           TIME_SHARE of the time the others' step takes,
                                           saved up over steps when that is under one token
                                           (so a long prefill may sit some steps out, never
                                           for good); in a step with nothing else, about
                                           GAP_STEPS of the others' step times right after
                                           them, up to T; never more than twice the previous
                                           step's (from 1)
    at most max_long_partial_prefills      long ones in progress at once; a long waiting
                                           request is passed over, shorter ones behind it
                                           are admitted
    at most max_num_partial_prefills       prompts left unfinished by a step at once

The times come from the scheduler's clock between back-to-back steps: the recent steps
without long tokens give the others' step time, the others with long tokens the time of one
long token (which grows with the prompt's context). So the other requests' steps take about
1 + TIME_SHARE times as long as alone and the long prefill gets the rest of the machine; on a
GPU, where a prompt token costs next to nothing, the long prefills get T tokens a step.

A request arriving while a long prefill runs alone waits for that step, and one long token
deep into a long context can cost many decode steps. So when the other requests have just
ended and only long prefills are left, the engine loop first waits a moment for the next
request (`hold_s`): as long as the recent gaps between the others' end and the next arrival
(a client sending one request after another), and only while that is shorter than the
alone step it puts off. A long prefill loses at most that moment each time the others end.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.core.sequence import Sequence


def is_long_prefill(threshold: int, req: Sequence) -> bool:
    """Whether `req` (running or waiting) is a long prefill under `threshold` (0: none is):
    more than `threshold` tokens left to compute, or a prompt of more than `threshold`
    tokens beyond its prefix-cache hits that is still being computed."""
    return _long(threshold, req, req.num_tokens - req.num_computed_tokens)


def _long(threshold: int, req: Sequence, left: int) -> bool:
    """is_long_prefill with `left` tokens left to compute (a waiting request: after its
    prefix-cache hits). A request admitted before (a preempted one) counts its first
    admission's hits, as it did while running."""
    if left <= 1 or threshold <= 0:
        return False
    uncached = req.num_tokens - req.num_cached_tokens if req.num_cached_tokens >= 0 else left
    return threshold < max(left, uncached)


class LongPrefills:
    """The long-prefill rule of one scheduler (see the module docstring), and what it
    remembers between steps: the step times it measured, the long prefills' saved-up share
    and what they took in the previous step.

    Args:
        threshold: long_prefill_token_threshold; 0 turns the long-prefill rule off.
        max_partial: max_num_partial_prefills.
        max_long_partial: max_long_partial_prefills.
    """

    TIME_SHARE = 0.5  # long prefills' time beside other work, over the others' step time
    # Alone right after other work (between two of its requests, say): a step of about this
    # many of the others' step times, doubling from there, so a request arriving then waits
    # little.
    GAP_STEPS = 2.0
    # Beside other work, at least one step in this many has no long tokens, so that the
    # others' own step time stays measured as it changes.
    _PROBE_EVERY = 8

    # Gaps between the others' end and the next arrival kept, and the share of them a hold
    # covers (a high quantile: most returning clients, not the slowest).
    HOLD_SAMPLES = 16
    HOLD_QUANTILE = 0.8
    HOLD_MARGIN_S = 0.002

    __slots__ = (
        "after_others", "credit", "gaps", "last_step_tokens", "max_long_partial", "max_partial",
        "others_end", "others_s", "shared_steps", "threshold", "token_s",
    )  # fmt: skip

    def __init__(self, threshold: int, max_partial: int, max_long_partial: int) -> None:
        self.threshold = threshold
        self.max_partial = max_partial
        self.max_long_partial = max_long_partial
        self.last_step_tokens = 0
        self.credit = 0.0  # long tokens saved up beside other work
        self.others_s: float | None = None  # a step's time without long tokens
        self.token_s: float | None = None  # one long token's time on top of that
        # steps with long tokens beside other work since the last without (alone steps, in
        # between, count for neither: a short request's few steps then still get a probe)
        self.shared_steps = 0
        self.after_others = False  # the previous step had other work
        self.gaps: deque[float] = deque(maxlen=self.HOLD_SAMPLES)
        self.others_end: float | None = None  # when the others last ended, until an arrival

    def is_long_waiting(self, req: Sequence, tokens_left: int) -> bool:
        """Whether waiting request `req`, with `tokens_left` tokens to compute after its
        prefix-cache hits, is a long prefill (as `is_long_prefill` will say once it runs)."""
        return _long(self.threshold, req, tokens_left)

    def in_progress(self, req: Sequence) -> bool:
        """Whether running request `req` is a long prefill (`is_long_prefill`)."""
        return is_long_prefill(self.threshold, req)

    def observe(self, others: int, longs: int, seconds: float) -> None:
        """The previous step, of `others` + `longs` tokens, took `seconds` (back to back)."""
        if others <= 0:  # alone: nothing to compare with
            return
        if longs <= 0:
            self.others_s = _cautious(self.others_s, seconds, up=False)
        elif self.others_s is not None and seconds > self.others_s:
            self.token_s = _cautious(self.token_s, (seconds - self.others_s) / longs, up=True)

    def share(self, others: int) -> int:
        """Tokens all long prefills together may take this step, whose other requests took
        `others` tokens (see the module docstring); the caller then `spend`s what they took."""
        # At most twice the previous step's: a wrong guess of the times costs one small step.
        most = min(self.threshold, max(1, 2 * self.last_step_tokens))
        known = self.others_s is not None and self.token_s is not None
        if others <= 0:
            if self.after_others and known:
                gap = self.GAP_STEPS * self.others_s / self.token_s  # type: ignore[operator]
                return min(most, max(1, int(gap)))
            return most
        if self.others_s is None or self.shared_steps >= self._PROBE_EVERY:
            return 0  # this step times the others alone
        # Until both times are known: one token a step.
        rate = self.TIME_SHARE * self.others_s / self.token_s if known else 1.0  # type: ignore[operator]
        self.credit = min(self.credit + rate, float(most))
        return int(self.credit)

    def spend(self, tokens: int, others: int, any_long: bool) -> None:
        """Long prefills took `tokens` this step (beside `others` tokens); `any_long`: some
        are still in progress or waiting for their turn (else nothing is saved up)."""
        if tokens or others <= 0:  # (a step they sat out beside others keeps the last)
            self.last_step_tokens = tokens
        if not any_long:
            self.credit = 0.0
        elif others > 0:
            self.credit = max(0.0, self.credit - tokens)
        if others > 0:
            self.shared_steps = self.shared_steps + 1 if tokens else 0
        self.after_others = others > 0

    def hold_s(self, now: float) -> float:
        """The others ended at `now` and only long prefills are left: seconds to wait for
        the next request before their alone step (0: do not wait)."""
        self.others_end = now
        if len(self.gaps) < self.HOLD_SAMPLES // 4 or self.token_s is None:
            return 0.0
        ranked = sorted(self.gaps)
        # An arrival is stamped when the server got it, a little before the engine does.
        hold = ranked[int(self.HOLD_QUANTILE * (len(ranked) - 1))] + self.HOLD_MARGIN_S
        # The alone step it would otherwise start (share(0)'s first tokens, at least one).
        step_s = max(self.token_s, self.GAP_STEPS * (self.others_s or 0.0))
        return hold if hold < step_s else 0.0

    def arrived(self, arrival_time: float) -> None:
        """A request arrived at `arrival_time`: the first one after the others ended is a
        gap sample (0 when it came before)."""
        if self.others_end is not None:
            self.gaps.append(max(0.0, arrival_time - self.others_end))
            self.others_end = None


def _cautious(average: float | None, sample: float, up: bool) -> float:
    """A running average of step times that jumps to a sample in the cautious direction
    (`up`: towards dearer long tokens; else towards cheaper steps of the others, which a big
    prompt step would otherwise inflate) and follows it slowly in the other."""
    if average is None or (sample > average) == up:
        return sample
    return 0.9 * average + 0.1 * sample
