"""Admitting waiting requests into a step: the scheduler's second phase, after its running
requests (core/scheduler.py).

Waiting requests are tried in the policy's order (`admission_candidates`) while the step has
budget, seats and KV blocks. A long prefill (core/long_prefills.py) is passed over while
`max_long_partial_prefills` long ones are in progress, and any prompt the step would leave
unfinished while `max_num_partial_prefills` are: the requests behind it are tried instead,
in the same order, so a short request never waits for a long one.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Protocol

from conveyor.core.chunking import is_partial, num_tokens_to_schedule
from conveyor.core.long_prefills import LongPrefills
from conveyor.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from conveyor.core.block_manager import BlockManager
    from conveyor.core.policy_base import SchedulingPolicy
    from conveyor.core.waiting_queue import WaitingQueue


class AdmittingScheduler(Protocol):
    """What admission reads of the scheduler (core/scheduler.py's Scheduler is one), named
    here so that this module does not import the one that imports it."""

    running: list[Sequence]
    waiting: WaitingQueue
    block_manager: BlockManager
    policy: SchedulingPolicy
    long_prefills: LongPrefills
    max_num_seqs: int


def admit_waiting(
    sched: AdmittingScheduler,
    budget: int,
    scheduled: list[Sequence],
    num_scheduled: dict[str, int],
    admitted: list[Sequence],
    now: float,
    skip: set[str],
    long_share: int,
) -> tuple[int, int, bool]:
    """Admit waiting requests in policy order, except `skip` ids, appending them to
    `scheduled` and `admitted`. A long prefill takes at most `long_share` tokens and is
    passed over while the long (or partial) prefills in progress are at their limits.
    Returns the budget left, the tokens long prefills took and whether a long one was
    admitted or passed over."""
    running = sched.running
    bm = sched.block_manager
    rule = sched.long_prefills
    num_running = len(running)
    # Prefills in progress after this step, and the long ones (counted when needed).
    num_partial = num_long = -1
    long_tokens = 0
    # Without passing over, the loop consumes at most `seats + len(skip)` candidates: each
    # is skipped (a `skip` id, each in waiting once), admitted (taking a seat) or ends
    # it; so the policy's first that many give the same admissions. Each request passed
    # over widens that window by one: more candidates are asked for (twice as many each
    # time, so a long queue costs O(its length) per step, not its square).
    limit = sched.max_num_seqs - num_running + len(skip)
    seen = passed = 0
    saw_long = False
    while True:
        candidates = sched.policy.admission_candidates(
            sched.waiting, now, running[:num_running], limit
        )
        ended = False
        for req in itertools.islice(candidates, seen, None):
            seen += 1
            if budget <= 0 or len(running) >= sched.max_num_seqs:
                ended = True
                break
            if req.request_id in skip:
                continue
            # Waiting requests hold nothing; a preempted one recomputes prompt + outputs,
            # both minus what the prefix cache still holds (their own freed blocks
            # included). Prompt logprobs and mean pooling read every prompt token's row:
            # no cache hits for them. (Last-token pooling takes hits: the last token is
            # always computed.)
            every_row = req.sampling_params.needs_every_prompt_row
            hits = [] if every_row else bm.get_computed_blocks(req)
            num_cached = len(hits) * bm.block_size
            n = num_tokens_to_schedule(req, num_cached, budget)
            left = req.num_tokens - num_cached
            long = rule.is_long_waiting(req, left)
            saw_long = saw_long or long
            if long or left - n > 1:  # it would be a prefill in progress after this step
                if num_partial < 0:
                    num_partial = sum(
                        is_partial(r, num_scheduled.get(r.request_id, 0)) for r in running
                    )
                    num_long = sum(map(rule.in_progress, running))
                if num_partial >= rule.max_partial or (
                    long and (num_long >= rule.max_long_partial or long_share <= 0)
                ):
                    passed += 1
                    continue
                if long:
                    n = min(n, long_share)
            if not bm.allocate_slots(req, n, hits):
                ended = True
                break
            if bm.enable_prefix_caching:
                bm.record_lookup(req.num_tokens, num_cached)
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:  # the first admission's hits are the ones reported
                req.num_cached_tokens = num_cached
            req.status = SequenceStatus.RUNNING
            req.admitted_at = now
            running.append(req)
            admitted.append(req)
            scheduled.append(req)
            num_scheduled[req.request_id] = n
            budget -= n
            if left - n > 1:
                num_partial += 1
            if long:
                num_long += 1
                long_share -= n
                long_tokens += n
        # Done unless requests were passed over and the policy may hold more candidates.
        if ended or not passed or len(candidates) < limit or seen >= len(sched.waiting):
            break
        limit = max(2 * limit, seen + sched.max_num_seqs - len(running) + len(skip))
    for req in admitted:  # O(1) each, wherever it stood in the queue
        sched.waiting.remove(req)
        sched.policy.on_dequeue(req)
    return budget, long_tokens, saw_long
