"""Token-budget scheduler: continuous batching with chunked prefill and preemption.

Every step hands out at most `max_num_batched_tokens` new tokens to at most `max_num_seqs`
requests. One counter covers every phase: a request gets up to
`num_tokens - num_computed_tokens` tokens, so a long prompt is split over steps (chunked
prefill), a decoding request gets 1, and a preempted request recomputes everything.

    running (admission order)          waiting (policy order)
    [A decode][B chunk 2/3][C decode]  [P (preempted) ][D new][E new]
       1 tok     k toks       1 tok       admitted while budget, seqs and blocks allow;
                                          a prompt larger than the budget left is chunked
    When a running request cannot get a block, the policy's victim (by default the most
    recently admitted) is preempted: blocks freed, num_computed_tokens = 0, re-queued at the
    front of waiting. A step that preempted for lack of blocks admits nothing new.
A request with prompt_logprobs computes its prompt in chunks of at most PROMPT_LOGPROBS_CHUNK
tokens (core/chunking.py), so its vocabulary-wide prompt rows never stall the others' step.
Long prefills (more than `long_prefill_token_threshold` tokens left) are scheduled after the
other running requests and share the step with them (core/long_prefills.py): at most
`max_long_partial_prefills` of them run at once, and a long waiting request is passed over
while they do, so shorter requests behind it in policy order are admitted (the policy's order
among the admitted ones is kept). At most `max_num_partial_prefills` prompts are left
unfinished by a step at once.
An embedding request (`sampling_params.pooling`) runs its prompt like any prefill and is
never sampled; mean pooling skips the prefix cache, last-token pooling does not.

Deadlines: a request with `sampling_params.deadline` that is still unfinished when a step
starts at or after `arrival_time + deadline` is aborted there, waiting or running: status
FINISHED_ABORTED, `abort_reason` set, blocks freed at once, reported in finished_request_ids.
The clock is `time.monotonic` (the engine's arrival clock) unless a simulator passes its own.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from conveyor.core.admission import admit_waiting
from conveyor.core.block_manager import BlockManager
from conveyor.core.chunking import num_tokens_to_schedule
from conveyor.core.limits import check_kv_fits
from conveyor.core.long_prefills import LongPrefills, is_long_prefill
from conveyor.core.policies import make_policy
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence, SequenceStatus
from conveyor.core.tenant_shares import TenantShares
from conveyor.core.waiting_queue import WaitingQueue

if TYPE_CHECKING:  # annotations only: core/ does not import engine/ at run time
    from conveyor.config import EngineConfig

# For the per-request loops: a global is read far faster than an enum class's member
# (EnumType's attribute hook; docs/kernels.md#measured-choices).
_RUNNING = SequenceStatus.RUNNING


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes.

    Invariants between calls: every unfinished request is in exactly one of `waiting`
    (status WAITING or PREEMPTED, holding no blocks) and `running` (status RUNNING);
    `len(running) <= max_num_seqs`; finished requests hold no blocks.
    """

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        """Args:
        config: engine config with `num_kv_blocks` and `max_model_len` already resolved.
        clock: seconds, on the same clock as the requests' `arrival_time`; read once per
            step for aging, cooldowns and deadlines (a simulator passes simulated time).
        """
        if config.num_kv_blocks is None or config.max_model_len is None:
            raise ValueError(
                "num_kv_blocks and max_model_len must be resolved before building the scheduler."
            )
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.policy = make_policy(config.scheduler, config, self.block_manager)
        self.long_prefills = LongPrefills(
            config.long_prefill_token_threshold,
            config.max_num_partial_prefills,
            config.max_long_partial_prefills,
        )
        self.tenant_shares = TenantShares()
        # Unfinished requests by tenant: with one tenant (and none in its grace time) the
        # tenant rule has nothing to do, known without a look at the requests.
        self._tenants: Counter[str] = Counter()
        # The previous step's start, tokens and long-prefill tokens, to time it for the long
        # prefills' share (LongPrefills.observe) when the next step follows it back to back
        # (0 tokens: the engine may have idled in between).
        self._step_at = 0.0
        self._step_tokens = self._step_long = 0
        self.clock = clock
        # Queue positions (WaitingQueue) go to the policy with every enqueue (on_enqueue).
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        # Unfinished requests by id, for finish_requests().
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        # Finished since the previous schedule(); handed over in its output.
        self._finished_ids: list[str] = []
        # (deadline_at, tie-breaker, request) of requests with a deadline; finished ones are
        # dropped lazily when they reach the top.
        self._deadlines: list[tuple[float, int, Sequence]] = []
        self._deadline_seq = itertools.count()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0..1)."""
        return self.block_manager.usage

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Sequence) -> None:
        """Queue a new request at the back of `waiting`.

        Raises:
            ValueError: duplicate id; PromptError (a ValueError): empty prompt, or a request
                whose prompt plus `max_tokens` could never fit in the whole KV cache (it
                would wait forever).
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use.")
        bm = self.block_manager
        check_kv_fits(
            request.num_prompt_tokens, request.max_tokens, bm.num_total_blocks * bm.block_size
        )
        request.status = SequenceStatus.WAITING
        self.requests[request.request_id] = request
        self.long_prefills.arrived(request.arrival_time)
        self.tenant_shares.arrived(request.tenant, request.arrival_time)
        self._tenants[request.tenant] += 1
        self.policy.on_enqueue(request, self.waiting.append(request))
        deadline_at = request.deadline_at
        if deadline_at != math.inf:
            heapq.heappush(self._deadlines, (deadline_at, next(self._deadline_seq), request))

    def hold_s(self) -> float:
        """Seconds the engine loop may wait for a new request before the next step: > 0 only
        when that step would run long prefills alone right after other work ended
        (LongPrefills.hold_s), or one tenant's work alone right after another tenant's
        ended (TenantShares.hold_s)."""
        hold = self._long_hold_s() or self._tenant_hold_s()
        if hold:  # the wait is no part of the previous step's time (the rules' observe)
            self._step_tokens = 0
        return hold

    def _long_hold_s(self) -> float:
        rule = self.long_prefills
        if not (rule.threshold and rule.after_others and self.has_unfinished_requests()):
            return 0.0
        if not all(map(rule.in_progress, self.running)):
            return 0.0
        if not all(rule.is_long_waiting(r, r.num_tokens) for r in self.waiting):
            return 0.0
        return rule.hold_s(self.clock())

    def _tenant_hold_s(self) -> float:
        shares = self.tenant_shares
        if len(self._tenants) != 1 or not shares.in_grace():
            return 0.0
        return shares.hold_s(self.clock(), self._tenants, len(self.running))

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV blocks.

        Running requests come first (decode token or next prompt chunk), then waiting ones
        in policy order. Does not advance `num_computed_tokens`; `update_from_output` does.
        May preempt running requests (they show in `preempted_request_ids`).

        Returns:
            The step's SchedulerOutput (possibly empty).
        """
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        num_scheduled: dict[str, int] = {}
        preempted_ids: list[str] = []
        admitted: list[Sequence] = []
        running = self.running
        now = self.clock()
        rule = self.long_prefills
        if self._step_tokens:
            seconds = now - self._step_at
            rule.observe(self._step_tokens - self._step_long, self._step_long, seconds)
            if not self._step_long:
                self.tenant_shares.observe(seconds)
        if self._deadlines and self._deadlines[0][0] <= now:
            self._expire_deadlines(now)

        if self.waiting and running:
            for victim in self.policy.select_preemptions(running, self.waiting, now):
                if victim.status is SequenceStatus.RUNNING:
                    self._preempt(victim, running.index(victim), preempted_ids)
        num_policy_preemptions = len(preempted_ids)

        # 1. Running requests, in admission order; long prefills after the others, since their
        #    share of the step depends on what the others took.
        longs: list[Sequence] = []
        # With no free KV block the long-prefill rule is off: a long prefill then holds blocks
        # that others wait for, and it must finish (in running order, as any) to free them.
        pressed = self.block_manager.num_free_blocks == 0
        order, allow, given = self._tenant_order(pressed, now)
        budget, stopped = self._schedule_running(
            order, budget, scheduled, num_scheduled, preempted_ids,
            None if pressed else longs, None, rule.threshold if pressed else 0, allow,
        )  # fmt: skip
        if allow is not None:  # back in running order (tenants were taken in rotation)
            scheduled[:] = [r for r in running if r.request_id in num_scheduled]
            self.tenant_shares.spend(given - sum(allow.values()))
        else:
            self.tenant_shares.spend(0)
        others = self.max_num_batched_tokens - budget
        long_tokens = 0
        waiting_long = False
        # Nothing but long prefills is running and a short request waits: it joins this step,
        # so it is admitted first and the long prefills take their share beside it, not the
        # (dearer) one they would take alone.
        joining = bool(longs) and not others and self._short_request_waits()
        if joining:
            budget, long_tokens, waiting_long = self._admit(
                budget, scheduled, num_scheduled, admitted, preempted_ids,
                num_policy_preemptions, now, 0,
            )  # fmt: skip
            others = self.max_num_batched_tokens - budget
        share = rule.share(others) if rule.threshold and (longs or self.waiting) else 0
        if longs and share > 0 and not stopped:
            cap = max(1, share // len(longs))
            budget, stopped = self._schedule_running(
                longs, budget, scheduled, num_scheduled, preempted_ids, None, cap
            )
            long_tokens += sum(num_scheduled.get(r.request_id, 0) for r in longs)
            # Back in running order (the deferred long ones were appended last).
            scheduled[:] = [r for r in running if r.request_id in num_scheduled]

        # 2. Waiting requests (unless admitted above).
        if not joining:
            budget, admitted_long, waiting_long = self._admit(
                budget, scheduled, num_scheduled, admitted, preempted_ids,
                num_policy_preemptions, now, share - long_tokens,
            )  # fmt: skip
            long_tokens += admitted_long
        total = self.max_num_batched_tokens - budget
        if rule.threshold:
            rule.spend(long_tokens, total - long_tokens, bool(longs) or waiting_long)
        self._step_at, self._step_tokens, self._step_long = now, total, long_tokens

        get_table = self.block_manager.get_block_table
        finished_ids, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            block_tables={r.request_id: get_table(r.request_id) for r in scheduled},
            preempted_request_ids=preempted_ids,
            finished_request_ids=finished_ids,
            admitted=admitted,
        )

    def _tenant_order(
        self, pressed: bool, now: float
    ) -> tuple[list[Sequence], dict[str, int] | None, int]:
        """The running requests in the order the step takes them, the decode rows each
        tenant may take (core/tenant_shares.py; None: no limit) and their sum. Long prefills
        are not counted (they have their own share) unless `pressed` (no free block: the
        long rule is off)."""
        running, shares = self.running, self.tenant_shares
        if len(self._tenants) <= 1 and not shares.in_grace():
            shares.allowances({}, {})  # (a step of one tenant's work)
            return running[:], None, 0
        threshold = 0 if pressed else self.long_prefills.threshold
        work = [
            (r, r.num_tokens - r.num_computed_tokens)
            for r in running
            if not (threshold and is_long_prefill(threshold, r))
        ]
        seats = len(running) < self.max_num_seqs and self.block_manager.num_free_blocks > 0
        waiting = itertools.islice(self.waiting, shares.WAITING_LOOKED_AT) if seats else ()
        allow = shares.allowances(*shares.demands(work, waiting, now))
        if allow is None:
            return running[:], None, 0
        by_tenant: dict[str, list[Sequence]] = {}
        for r in running:
            by_tenant.setdefault(r.tenant, []).append(r)
        order: list[Sequence] = []
        for tenant, reqs in by_tenant.items():
            order += shares.rotate(tenant, reqs, allow.get(tenant, len(reqs)))
        return order, allow, sum(allow.values())

    def _short_request_waits(self) -> bool:
        """Whether one of the first few waiting requests is a short one never preempted (a
        few: the queue may be long, and a wrong guess only changes one step's share). A
        preempted one waits its turn: going first again, it could retake the blocks the long
        prefill needs each time and starve it."""
        is_long = self.long_prefills.is_long_waiting
        return any(
            not is_long(r, r.num_tokens) and not r.num_preemptions
            for r in itertools.islice(self.waiting, 8)
        )

    def _admit(
        self,
        budget: int,
        scheduled: list[Sequence],
        num_scheduled: dict[str, int],
        admitted: list[Sequence],
        preempted_ids: list[str],
        num_policy_preemptions: int,
        now: float,
        long_share: int,
    ) -> tuple[int, int, bool]:
        """Admits waiting requests into the step (admission.admit_waiting), unless blocks
        ran short this step (admitting more would only be preempted again next step).
        Returns the budget left, the tokens long prefills took and whether a long one was
        admitted or passed over."""
        if not (
            len(preempted_ids) == num_policy_preemptions
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and self.block_manager.num_free_blocks > 0
            and self.policy.may_admit(self.running)
        ):
            return budget, 0, False
        # Requests the policy just preempted are not re-admitted in the same step.
        if num_policy_preemptions:  # a long prompt the policy preempted for is admitted
            long_share = max(long_share, 1)
        return admit_waiting(
            self, budget, scheduled, num_scheduled, admitted, now, set(preempted_ids), long_share
        )

    def _schedule_running(
        self,
        reqs: list[Sequence],
        budget: int,
        scheduled: list[Sequence],
        num_scheduled: dict[str, int],
        preempted_ids: list[str],
        longs: list[Sequence] | None,
        cap: int | None,
        long_cap: int = 0,
        allow: dict[str, int] | None = None,
    ) -> tuple[int, bool]:
        """Schedule running requests `reqs` in order, each at most `cap` tokens (None: no
        cap), preempting the policy's victims when blocks run out. With `longs`, long
        prefills are appended there instead; with `long_cap`, they are scheduled in place,
        at most that many tokens; with `allow`, a tenant's decode rows are at most its rows
        left there (those of a tenant not in it are not limited). Returns the budget left and
        whether a request had to preempt itself (nothing was left to take blocks from: the
        step stops there)."""
        running = self.running
        allocate_slots = self.block_manager.allocate_slots
        threshold = self.long_prefills.threshold if longs is not None else 0
        for req in reqs:
            if budget <= 0:
                break
            if req.status is not _RUNNING:  # preempted earlier in this step
                continue
            computed = req.num_computed_tokens
            if threshold and is_long_prefill(threshold, req):
                longs.append(req)  # type: ignore[union-attr]
                continue
            n = num_tokens_to_schedule(req, computed, budget)
            if cap is not None and n > cap:
                n = cap
            if long_cap and n > long_cap and is_long_prefill(long_cap, req):
                n = long_cap
            if n <= 0:  # Nothing to compute (its sampled token never came back).
                continue
            left = None if allow is None else allow.get(req.tenant)
            if left is not None and computed >= req.num_prompt_tokens:  # a decode row
                if left <= 0:
                    continue
                allow[req.tenant] = left - 1  # type: ignore[index]
            while not allocate_slots(req, n):
                victim = self.policy.select_victim(running)
                vi = len(running) - 1 if running[-1] is victim else running.index(victim)
                self._preempt(victim, vi, preempted_ids)
                if victim is req:
                    return budget, True
                freed = num_scheduled.pop(victim.request_id, 0)
                if freed:  # an earlier request of this step gave way
                    budget += freed
                    scheduled.remove(victim)
            scheduled.append(req)
            num_scheduled[req.request_id] = n
            budget -= n
        return budget, False

    def _expire_deadlines(self, now: float) -> None:
        """Abort every unfinished request whose deadline is at or before `now`."""
        heap = self._deadlines
        expired: list[str] = []
        while heap and heap[0][0] <= now:
            _, _, req = heapq.heappop(heap)
            if not req.is_finished:
                req.abort_reason = (
                    f"deadline exceeded: not finished {req.sampling_params.deadline:g} s "
                    "after arrival"
                )
                expired.append(req.request_id)
        self.finish_requests(expired, SequenceStatus.FINISHED_ABORTED)

    def _preempt(self, req: Sequence, index: int, preempted_ids: list[str]) -> None:
        """Recompute-preempt running[index] (== req): free blocks, re-queue at the front."""
        del self.running[index]
        self.block_manager.free(req)
        req.status = SequenceStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.on_enqueue(req, self.waiting.appendleft(req))
        preempted_ids.append(req.request_id)

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Sequence]:
        """Apply one executed step.

        For every scheduled request still running: advance `num_computed_tokens` by its
        scheduled count; if it was sampled, append the token and apply `check_stop()`.
        Finished requests leave `running` and free their blocks at once. Requests finished
        from outside between schedule() and now (aborts) are skipped. A request whose
        append or stop check raises ends FINISHED_ABORTED with the exception in `fault`;
        the others are updated as usual.

        Args:
            output: the SchedulerOutput this step executed.
            sampled_token_ids: request id -> sampled token, for the requests that reached
                the end of their known tokens.
        Returns:
            The requests that got a new token (finished ones included, with final status).
        """
        new_token_reqs: list[Sequence] = []
        any_finished = False
        num_scheduled = output.num_scheduled_tokens
        for req in output.scheduled:
            if req.status is not _RUNNING:
                continue
            rid = req.request_id
            req.num_computed_tokens += num_scheduled[rid]
            token_id = sampled_token_ids.get(rid)
            if token_id is None:
                continue
            new_token_reqs.append(req)
            try:
                req.append_output_token(token_id)
                status = req.check_stop()
            except Exception as exc:  # its own fault: it alone ends, the step goes on
                req.fault, status = exc, SequenceStatus.FINISHED_ABORTED
            if status is not None:
                self._finish(req, status)
                any_finished = True
        if any_finished:
            self.running[:] = [r for r in self.running if r.status is _RUNNING]
            if not (self.running or self.waiting):
                self._step_tokens = 0  # the engine may idle before the next step
        return new_token_reqs

    def finish_requests(self, request_ids: Iterable[str], status: SequenceStatus) -> list[Sequence]:
        """Finish requests from outside: abort, or a stop string the detokenizer matched.

        Frees their blocks and removes them from `waiting` / `running`. Unknown and
        already-finished ids are ignored.

        Args:
            request_ids: ids to finish.
            status: a finished status (e.g. FINISHED_ABORTED, FINISHED_STOPPED).
        Returns:
            The requests this call finished.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}.")
        finished: list[Sequence] = []
        any_running = False
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:  # Unknown, or already finished.
                continue
            if req.status is _RUNNING:
                any_running = True
            else:
                self.waiting.remove(req)
                self.policy.on_dequeue(req)
            self._finish(req, status)
            finished.append(req)
        # One filtering pass over running, not one O(n) removal per request.
        if any_running:
            self.running[:] = [r for r in self.running if r.status is _RUNNING]
        if not (self.running or self.waiting):
            self._step_tokens = 0
        return finished

    def _finish(self, req: Sequence, status: SequenceStatus) -> None:
        """Mark finished, free blocks, forget the id (the caller removes it from its queue)."""
        req.status = status
        self.block_manager.free(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
        tenant = req.tenant
        self._tenants[tenant] -= 1
        if not self._tenants[tenant]:
            del self._tenants[tenant]
            self.tenant_shares.ended(tenant)
