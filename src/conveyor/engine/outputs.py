"""What a request returns, shaped like vLLM's outputs so user code carries over."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token, its 1-based rank among all tokens, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: the sampled token and the top-N alternatives.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (a request with n > 1 has n of these)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Why the engine aborted it, e.g. "deadline exceeded: ..."; None unless it did.
    abort_reason: str | None = None


@dataclass(slots=True)
class RequestMetrics:
    """When a request passed each milestone, in `time.monotonic()` seconds (None: not yet)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step.

    `outputs` hold cumulative text and tokens, or only what is new since the request's
    previous output for a request added with `delta=True` (AsyncLLM); `finished` turns True
    once every one of the n sequences has ended. `error` is set when the request failed
    inside the engine; `error_param` too when that was its own mistake (the field at fault,
    e.g. "structured_outputs" for a grammar that did not compile in time).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    metrics: RequestMetrics | None = None
    # Prompt tokens whose K/V came from the prefix cache (of the first sample, the one that
    # stands for the prompt when n > 1), as vLLM reports it.
    num_cached_tokens: int = 0
    # vLLM's prompt_logprobs: None for the first prompt token, then each token's entry; set in
    # the first output after the prompt was computed (in every later one too unless delta).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error_param: str | None = None
    # An embedding request's vector (SamplingParams.pooling), in its final output only.
    embedding: list[float] | None = None

    def add(self, delta: RequestOutput) -> None:
        """Fold a later delta output of the same request into this one (like vLLM's `add`).

        Args:
            delta: the next output of this request; its text, tokens and logprobs are
                appended, its finish state and cumulative logprob replace ours.
        """
        by_index = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            old = by_index.get(new.index)
            if old is None:
                logprobs = None if new.logprobs is None else list(new.logprobs)
                self.outputs.append(
                    dataclasses.replace(new, token_ids=list(new.token_ids), logprobs=logprobs)
                )
                continue
            old.text += new.text
            old.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                if old.logprobs is None:
                    old.logprobs = []
                old.logprobs.extend(new.logprobs)
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason = new.finish_reason
            old.stop_reason = new.stop_reason
            old.abort_reason = new.abort_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = delta.finished
        self.error = delta.error
        self.error_param = delta.error_param
        self.metrics = delta.metrics
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            self.embedding = delta.embedding


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, shaped as vLLM's EmbeddingRequestOutput."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


class MetricName:
    """The engine's metric names: /metrics (entrypoints/metrics.py) and LLM.get_metrics() both
    use these, so the two never drift apart."""

    PROMPT_TOKENS = "conveyor:prompt_tokens"
    GENERATION_TOKENS = "conveyor:generation_tokens"
    NUM_PREEMPTIONS = "conveyor:num_preemptions"
    PREFIX_CACHE_QUERIES = "conveyor:prefix_cache_queries"
    PREFIX_CACHE_HITS = "conveyor:prefix_cache_hits"
    NUM_REQUESTS_RUNNING = "conveyor:num_requests_running"
    NUM_REQUESTS_WAITING = "conveyor:num_requests_waiting"
    KV_CACHE_USAGE_PERC = "conveyor:kv_cache_usage_perc"


@dataclass(slots=True, frozen=True)
class Metric:
    """One of the engine's counters or gauges (`LLM.get_metrics()`), named as on /metrics."""

    name: str
    kind: str  # "counter" (cumulative since start) or "gauge" (current value)
    value: float
