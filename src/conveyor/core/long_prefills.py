"""The long-prefill rule of the scheduler (`LongPrefills`).

A request with more than `long_prefill_token_threshold` (T) tokens left to compute is a long
prefill. On a CPU a step's time grows with its prompt tokens (a prompt token deep into a long
context can cost more than a whole decode step), so one long prompt taking the whole budget
stalls every decode and every short prompt for seconds. Instead, in each step:

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
"""

from __future__ import annotations


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

    __slots__ = (
        "after_others", "credit", "last_step_tokens", "max_long_partial", "max_partial",
        "others_s", "shared_steps", "threshold", "token_s",
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

    def is_long(self, tokens_left: int) -> bool:
        """Whether a request with `tokens_left` tokens to compute is a long prefill."""
        return 0 < self.threshold < tokens_left

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


def _cautious(average: float | None, sample: float, up: bool) -> float:
    """A running average of step times that jumps to a sample in the cautious direction
    (`up`: towards dearer long tokens; else towards cheaper steps of the others, which a big
    prompt step would otherwise inflate) and follows it slowly in the other."""
    if average is None or (sample > average) == up:
        return sample
    return 0.9 * average + 0.1 * sample
