"""LLMEngine: add_request / step / abort. One step = schedule, execute, update, emit.

The engine owns the tokenizer, the scheduler (core/) and the model runner (model/), and keeps
per-sequence text state (incremental detokenizer, logprobs). A request with n > 1 fans out
into n sequences `"{request_id}#{i}"` that are scheduled independently and reported together.
A request added with `delta=True` reports only what is new since its previous output (AsyncLLM
streams these); otherwise outputs are cumulative.
A fault of one request (non-finite logits, made an invalid token by the logits guard; an
exception in its token-level stop check, detokenizer, stop strings or logprobs) fails it
alone: finish_reason "abort", `error` set, blocks freed; the step goes on for the others. A
constraint that fails its request (it does not compile, or not in time, or allows no output)
sets `error_param` too: the request's own mistake, which the server answers with a 400.
An embedding request (`params.pooling`) runs its prompt through the same steps and finishes
in the step that computes its last prompt token: finish_reason "stop", no tokens, its vector
in `RequestOutput.embedding` (model/pooler.py pools; pooling_config.py reads the model's).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from conveyor.config import EngineConfig
from conveyor.core.limits import PromptLimits
from conveyor.core.scheduler import Scheduler
from conveyor.core.sequence import Sequence, SequenceStatus
from conveyor.engine.output_state import OutputState, RequestState
from conveyor.engine.outputs import Metric, MetricName, RequestMetrics, RequestOutput
from conveyor.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from conveyor.model.loading.checkpoint import check_checkpoint
from conveyor.model.loading.pooling_config import read_pooling_config
from conveyor.sampling_params import SamplingParams
from conveyor.structured.grammar import GrammarUnsatisfiableError
from conveyor.structured.grammar_cache import GrammarCache
from conveyor.structured.grammar_queue import GrammarQueue

logger = logging.getLogger(__name__)


class InvalidTokenError(RuntimeError):
    """A request was sampled a token outside the vocabulary (its logits were not finite)."""


class LLMEngine:
    """The synchronous engine under `LLM` and `AsyncLLM`."""

    def __init__(self, config: EngineConfig) -> None:
        if config.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={config.data_parallel_size}: one engine (LLM, LLMEngine, "
                "AsyncLLM without engine_process) is a single replica; serve replicas with "
                "`conveyor serve --data-parallel-size N`, or set data_parallel_size=1."
            )
        self.config = config
        # The file checks first: a wrong folder is named before any weight is read.
        check_checkpoint(config.model, config.tokenizer)
        # model None: the runner builds the demo checkpoint. tensor_parallel_size > 1: rank 0
        # of a group of worker processes (conveyor.parallel). Imported here, with torch: a
        # server whose engine runs in another process imports this module without either.
        from conveyor.parallel.launch import create_runner

        self.runner = create_runner(config)
        self.model_path = self.runner.model_path
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or self.model_path)
        # Resolve what the checkpoint and the memory budget decide, then build the scheduler.
        config.num_kv_blocks = self.runner.num_kv_blocks
        config.max_model_len = self.runner.max_model_len
        self.max_model_len = self.runner.max_model_len
        self.scheduler = Scheduler(config)
        # What any prompt must fit (plain numbers: safe to read from another thread).
        kv_capacity = self.scheduler.block_manager.num_total_blocks * config.block_size
        self.limits = PromptLimits(self.max_model_len, self.runner.vocab_size, kv_capacity)
        # How embedding requests pool (the checkpoint's sentence-transformers config, or
        # config.pooling_type); plain values, so the server side gets a copy.
        self.pooling = read_pooling_config(
            self.model_path, self.runner.model.config.hidden_size, config.pooling_type
        )
        self.grammars = GrammarCache(
            self.tokenizer.hf,
            self.runner.vocab_size,
            self.tokenizer.eos_token_ids,
            timeout_s=config.grammar_compile_timeout,
        )
        # Sequences with structured outputs whose grammar is still compiling.
        self._grammar_queue = GrammarQueue(self.grammars)
        self._parents: dict[str, RequestState] = {}
        self._seqs: dict[str, OutputState] = {}
        # What the current step scheduled (None until schedule() returned), for abort_step().
        self._step_scheduled: list[Sequence] | None = None
        self.last_step_num_tokens = 0  # tokens the latest step computed (prefill + decode)
        # Counted as the server's /metrics counts them: a request's prompt with its first
        # token, every sampled token.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        stream: bool = False,
        prompt_token_ids: list[int] | None = None,
        delta: bool = False,
    ) -> None:
        """Queue a request.

        Args:
            prompt: text (tokenized here unless `prompt_token_ids` is given) or token ids.
            stream: report the request after every step that changes it; otherwise only
                when it finishes.
            delta: each output holds only the text, tokens and logprobs that are new since
                the request's previous output (cumulative_logprob stays cumulative).
        Raises:
            ValueError: a duplicate id, an empty or invalid prompt, or a prompt that can
                never fit the model's context or the whole KV cache.
        """
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            prompt_ids = prompt_token_ids or self.tokenizer.encode(prompt)
        else:
            prompt_text, prompt_ids = None, list(prompt)
        if params.pooling is not None:  # the model's pooling, and dimensions it can give
            pooling_type = self.pooling.check_request(params.pooling.dimensions)
            if params.pooling.pooling_type is None:
                pooling = dataclasses.replace(params.pooling, pooling_type=pooling_type)
                params = dataclasses.replace(params, pooling=pooling)
        max_tokens = self.check_prompt(prompt_ids, params)
        params = self.tokenizer.with_bad_words(self.tokenizer.with_generation_eos(params))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        parent = RequestState(
            request_id, prompt_text, prompt_ids, stream, delta, RequestMetrics(arrival)
        )
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = {}
        for i in range(params.n):
            seq_params = params  # each sample's seeded stream comes from its sample_index
            if i > 0 and params.prompt_logprobs is not None:  # the first sample computes them
                seq_params = dataclasses.replace(seq_params, prompt_logprobs=None)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Sequence(
                seq_id,
                prompt_ids,
                seq_params,
                max_tokens=max_tokens,
                eos_token_id=self.tokenizer.eos_token_id,
                arrival_time=arrival,
                sample_index=i,
            )
            seq = OutputState(
                req,
                request_id,
                i,
                IncrementalDetokenizer(self.tokenizer, prompt_ids, seq_params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            parent.seqs.append(seq)
            self._seqs[seq_id] = seq
        self._parents[request_id] = parent
        so = params.structured_outputs
        for seq in parent.seqs:
            if so is None:
                self.scheduler.add_request(seq.request)
            else:  # joins the scheduler once its grammar is compiled (see step)
                self._grammar_queue.add(seq.request, self.grammars.get(so))

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Reject a prompt that can never run; return its output cap (see PromptLimits)."""
        return self.limits.check(prompt_ids, params)

    def abort_request(
        self, request_ids: str | list[str], reason: str | None = None
    ) -> list[RequestOutput]:
        """End requests with finish_reason "abort" and free their blocks at once.

        Args:
            request_ids: the requests to end (unknown ids are ignored).
            reason: reported as each sequence's `abort_reason` (None: a caller's abort).
        Returns:
            the final output of each aborted request that was still known.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            parent = self._parents.get(rid)
            if parent is None:
                continue
            for s in parent.seqs:
                if reason is not None and not s.request.is_finished:
                    s.request.abort_reason = reason
                if self._grammar_queue.remove(s.request.request_id) is not None:
                    s.request.status = SequenceStatus.FINISHED_ABORTED
            self.scheduler.finish_requests(
                [s.request.request_id for s in parent.seqs], SequenceStatus.FINISHED_ABORTED
            )
            parent.metrics.finished_time = time.monotonic()
            outputs.append(parent.output())
            self._forget(parent)
        return outputs

    def abort_step(self) -> list[RequestOutput]:
        """After `step()` raised: abort the requests that step scheduled, so the engine can
        keep serving the others. If it failed before scheduling anything, every request is
        aborted (the scheduler's state is suspect).

        Returns:
            the final output (finish_reason "abort") of each aborted request.
        """
        scheduled, self._step_scheduled = self._step_scheduled, None
        # What the failed step should have written into the blocks it registered is unknown.
        self.scheduler.block_manager.reset_prefix_cache()
        if scheduled is None:
            ids = list(self._parents)
        else:
            seqs = self._seqs
            parents = (seqs[r.request_id].parent_id for r in scheduled if r.request_id in seqs)
            ids = list(dict.fromkeys(parents))
        return self.abort_request(ids)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit; no-op otherwise)."""
        from conveyor.parallel.launch import shutdown_runner

        shutdown_runner(self.runner)
        self.grammars.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges now, under the names /metrics gives them."""
        s = self.scheduler
        bm = s.block_manager
        counters = {
            MetricName.PROMPT_TOKENS: self.num_prompt_tokens,
            MetricName.GENERATION_TOKENS: self.num_generation_tokens,
            MetricName.NUM_PREEMPTIONS: s.num_preemptions,
            MetricName.PREFIX_CACHE_QUERIES: bm.prefix_cache_queries,
            MetricName.PREFIX_CACHE_HITS: bm.prefix_cache_hits,
        }
        gauges = {
            MetricName.NUM_REQUESTS_RUNNING: s.num_running,
            MetricName.NUM_REQUESTS_WAITING: s.num_waiting,
            MetricName.KV_CACHE_USAGE_PERC: s.kv_usage,
        }
        return [Metric(k, "counter", float(v)) for k, v in counters.items()] + [
            Metric(k, "gauge", float(v)) for k, v in gauges.items()
        ]

    def unfinished_request_ids(self) -> list[str]:
        return list(self._parents)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, update requests, report outputs.

        Returns:
            one RequestOutput per streaming request that changed and per request that
            finished in this step.
        """
        self._step_scheduled = None
        compile_failures = self._admit_compiled() if self._grammar_queue else []
        sched_out = self.scheduler.schedule()
        self._step_scheduled = sched_out.scheduled
        self.last_step_num_tokens = sched_out.total_num_scheduled_tokens
        self.runner.remove_requests(sched_out.finished_request_ids)
        expired = compile_failures
        expired += self._report_finished_by_scheduler(sched_out.finished_request_ids)
        if sched_out.total_num_scheduled_tokens == 0:
            return expired
        now = time.monotonic()
        for req in sched_out.admitted:  # new, or back after preemption
            m = self._parents[self._seqs[req.request_id].parent_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        sampled, sampler_out, prompt_lps, embeddings = self.runner.execute(sched_out)
        for rid, entries in prompt_lps.items():
            seq = self._seqs.get(rid)
            if seq is not None:
                parent = self._parents[seq.parent_id]
                parent.add_prompt_logprobs(entries, self.tokenizer.id_to_token_text)
        if sampler_out is None:
            self.scheduler.update_from_output(sched_out, {})
            return expired + self._finish_embeddings(embeddings)
        tokens = {r.request_id: t for r, t in zip(sampled, sampler_out.token_ids, strict=True)}
        logprobs = dict(zip(tokens, sampler_out.logprobs, strict=True))
        outputs = expired
        vocab = self.runner.vocab_size
        for rid in [rid for rid, t in tokens.items() if not 0 <= t < vocab]:
            seq = self._seqs.get(rid)
            if seq is not None:  # None: it failed through a sibling sequence already
                error = InvalidTokenError(f"token {tokens[rid]} sampled for {rid!r}")
                outputs.append(self._fail(seq.parent_id, error))
        updated = self.scheduler.update_from_output(sched_out, tokens)  # skips failed ones
        outputs += self._finish_embeddings(embeddings)

        # The per-token loop: runs for every decoding request every step (hence the locals).
        touched: dict[str, RequestState] = {}
        decode = self.tokenizer.id_to_token_text
        seqs, parents = self._seqs, self._parents
        for req in updated:
            rid = req.request_id
            seq = seqs.get(rid)
            if seq is None:  # its request failed through a sibling sequence in this loop
                continue
            try:
                if req.fault is not None:  # its token-level stop check raised
                    raise req.fault
                if req.grammar is not None:
                    req.grammar.sync(req.output_token_ids)
                    if req.grammar.terminated:  # the constraint is complete: stop there
                        self.scheduler.finish_requests([rid], SequenceStatus.FINISHED_STOPPED)
                if seq.update(tokens[rid], logprobs[rid], decode):
                    self.scheduler.finish_requests([rid], SequenceStatus.FINISHED_STOPPED)
            except GrammarUnsatisfiableError as exc:  # a dead end of the request's constraint
                touched.pop(seq.parent_id, None)
                outputs.append(self._reject(seq.parent_id, exc, "structured_outputs"))
                continue
            except Exception as exc:
                touched.pop(seq.parent_id, None)
                outputs.append(self._fail(seq.parent_id, exc))
                continue
            touched[seq.parent_id] = parents[seq.parent_id]
        now = time.monotonic()
        self.num_generation_tokens += len(updated)
        for parent in touched.values():
            metrics = parent.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                self.num_prompt_tokens += len(parent.prompt_token_ids)
            if parent.finished:
                parent.metrics.finished_time = now
                outputs.append(parent.output())
                self._forget(parent)
            elif parent.stream:
                outputs.append(parent.output())
        return outputs

    def _finish_embeddings(self, embeddings: dict[str, list[float]]) -> list[RequestOutput]:
        """End the embedding requests whose vector this step pooled (after the scheduler's
        update, so their blocks are freed as any finished request's) and report them."""
        outputs = []
        now = time.monotonic()
        for rid, vector in embeddings.items():
            seq = self._seqs.get(rid)
            if seq is None:  # aborted while the step ran
                continue
            self.scheduler.finish_requests([rid], SequenceStatus.FINISHED_STOPPED)
            parent = self._parents[seq.parent_id]
            parent.embedding = vector
            parent.metrics.first_token_time = parent.metrics.finished_time = now
            self.num_prompt_tokens += len(parent.prompt_token_ids)
            outputs.append(parent.output())
            self._forget(parent)
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand the sequences whose grammar is compiled to the scheduler; fail those whose
        compile failed (a constraint that does not compile, or not in time, is the request's
        own mistake) and end those whose deadline passed while they waited. With nothing
        else to run, wait briefly for a compile (no spinning)."""
        now = time.monotonic()
        self.grammars.poll(now)
        idle = not self.scheduler.has_unfinished_requests()
        ready, failed, expired = self._grammar_queue.pop_ready(now, wait_s=0.05 if idle else 0.0)
        for req in ready:
            self.scheduler.add_request(req)
        outputs = []
        for req, exc in failed:
            req.status = SequenceStatus.FINISHED_ABORTED
            seq = self._seqs.get(req.request_id)
            if seq is None:  # it failed through a sibling sequence already
                continue
            if isinstance(exc, ValueError):
                outputs.append(self._reject(seq.parent_id, exc, "structured_outputs"))
            else:
                outputs.append(self._fail(seq.parent_id, exc))
        for req in expired:
            req.status = SequenceStatus.FINISHED_ABORTED
            req.abort_reason = (
                f"deadline exceeded: not finished {req.sampling_params.deadline:g} s after "
                "arrival (its grammar was still compiling)"
            )
        outputs += self._report_finished_by_scheduler([r.request_id for r in expired])
        return outputs

    def _report_finished_by_scheduler(self, finished_ids: list[str]) -> list[RequestOutput]:
        """Final outputs of requests the scheduler ended by itself (their deadline passed).

        Requests finished by a step or by `abort_request` were reported and forgotten then;
        whatever is still known and finished here ended inside `schedule()`.
        """
        outputs = []
        for rid in finished_ids:
            seq = self._seqs.get(rid)
            parent = None if seq is None else self._parents.get(seq.parent_id)
            if parent is not None and parent.finished:
                parent.metrics.finished_time = time.monotonic()
                outputs.append(parent.output())
                self._forget(parent)
        return outputs

    def _fail(self, request_id: str, exc: BaseException) -> RequestOutput:
        """Fail one request for a fault of its own: abort it, free its blocks, forget it.

        Returns:
            its final output (finish_reason "abort"), with `error` set for the caller.
        """
        logger.error("Sequence %s failed; the engine goes on without it.", request_id, exc_info=exc)
        (out,) = self.abort_request(request_id)
        out.error = f"The engine failed while running this request ({type(exc).__name__})."
        return out

    def _reject(self, request_id: str, exc: BaseException, param: str) -> RequestOutput:
        """Fail one request for a mistake of its own (`param` names the field): abort it,
        free its blocks, forget it.

        Returns:
            its final output (finish_reason "abort"), `error` and `error_param` set.
        """
        logger.info("Request %s refused: %s", request_id, exc)
        (out,) = self.abort_request(request_id)
        out.error, out.error_param = str(exc), param
        for c in out.outputs:  # a stop token may have ended it in the step that failed it
            c.finish_reason = "abort"
        return out

    def _forget(self, parent: RequestState) -> None:
        del self._parents[parent.request_id]
        for s in parent.seqs:
            self._seqs.pop(s.request.request_id, None)
