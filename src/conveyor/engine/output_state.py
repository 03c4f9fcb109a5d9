"""Engine-side output state of requests: text, logprobs and what was already reported.

`LLMEngine` schedules `Sequence`s (core/); this module keeps, per generated sequence, what the
user sees: the incremental detokenizer's text, the logprob dicts, and for delta (streaming)
outputs how much was handed out. A request with n > 1 is one `RequestState` with n
`OutputState`s, reported together in one `RequestOutput`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.core.logprobs import TokenLogprobs
from conveyor.core.sequence import Sequence, SequenceStatus
from conveyor.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from conveyor.engine.tokenizer import IncrementalDetokenizer

# A global: reading it off the enum class goes through EnumType's slow attribute hook, per token.
_STOPPED = SequenceStatus.FINISHED_STOPPED


@dataclass(slots=True)
class OutputState:
    """Output state of one generated sequence."""

    request: Sequence
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""  # text not yet handed out if delta, else all of it (no partial stop string)
    logprobs: list[dict[int, Logprob]] | None = None  # not yet reported ones, if delta
    cumulative_logprob: float | None = None
    num_sent_tokens: int = 0  # output tokens already reported (delta outputs)

    def add_logprobs(self, lp: TokenLogprobs, decode: Callable[[int], str]) -> None:
        """Record the sampled token's logprob and its top-N alternatives (vLLM's format)."""
        if self.logprobs is None:
            return
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, decode(lp.token_id))}
        for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
            if tid not in entry:
                entry[tid] = Logprob(value, rank, decode(tid))
        self.logprobs.append(entry)
        self.cumulative_logprob += lp.logprob

    def update(self, token_id: int, lp: TokenLogprobs | None, decode: Callable[[int], str]) -> bool:
        """Take the token a step sampled (already appended to the request by the scheduler):
        record its logprobs, detokenize it, look for stop strings.

        Returns:
            True if a stop string ended the sequence: the caller must finish it as stopped.
        """
        req = self.request
        if lp is not None:
            self.add_logprobs(lp, decode)
        detokenizer = self.detokenizer
        # eos / a stop token id ended it: like vLLM, its text is not part of the output.
        stop = detokenizer.update([token_id], stop_terminated=req.status == _STOPPED)
        finished = req.is_finished
        if stop is not None:
            req.stop_reason = stop
            if finished:  # the same token also hit eos or max_tokens: the stop string
                req.status = _STOPPED  # decides
            self.text += detokenizer.get_delta(True)
            return not finished
        delta = detokenizer.get_delta(finished)
        if delta:
            self.text += delta
        return False

    def completion(self, delta: bool) -> CompletionOutput:
        """This sequence as a CompletionOutput: cumulative, or only what is new if delta."""
        token_ids = self.request.output_token_ids
        if delta:  # hand over what is new and start collecting afresh
            text, self.text = self.text, ""
            token_ids, self.num_sent_tokens = token_ids[self.num_sent_tokens :], len(token_ids)
            logprobs = self.logprobs
            if logprobs is not None:
                self.logprobs = []
        else:
            text, token_ids = self.text, list(token_ids)
            logprobs = list(self.logprobs) if self.logprobs is not None else None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.request.status.finish_reason,
            stop_reason=self.request.stop_reason,
            abort_reason=self.request.abort_reason,
        )


@dataclass(slots=True)
class RequestState:
    """A user request: its prompt, how it reports, and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    stream: bool
    delta: bool
    metrics: RequestMetrics
    seqs: list[OutputState] = field(default_factory=list)
    # Prompt position -> its logprob entry, while prompt_logprobs are being computed (None:
    # not asked for); reported once complete, once if delta.
    prompt_logprobs: dict[int, dict[int, Logprob]] | None = None
    prompt_logprobs_sent: bool = False
    embedding: list[float] | None = None  # an embedding request's vector, once pooled

    def add_prompt_logprobs(
        self, entries: list[tuple[int, TokenLogprobs]], decode: Callable[[int], str]
    ) -> None:
        """Record prompt logprobs by position (a recompute after preemption overwrites)."""
        if self.prompt_logprobs is None:
            return
        for position, lp in entries:
            entry = {lp.token_id: Logprob(lp.logprob, lp.rank, decode(lp.token_id))}
            for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
                if tid not in entry:
                    entry[tid] = Logprob(value, rank, decode(tid))
            self.prompt_logprobs[position] = entry

    def _prompt_logprobs_out(self) -> list[dict[int, Logprob] | None] | None:
        lps = self.prompt_logprobs
        if lps is None or len(lps) < len(self.prompt_token_ids) - 1:
            return None
        if self.delta and self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return [None] + [lps[p] for p in range(1, len(self.prompt_token_ids))]

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # n == 1, the usual case: no generator per request and step
            return seqs[0].request.is_finished
        return all(s.request.is_finished for s in seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [s.completion(self.delta) for s in self.seqs],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=max(self.seqs[0].request.num_cached_tokens, 0),
            prompt_logprobs=self._prompt_logprobs_out(),
            embedding=self.embedding,
        )
