"""LLM: offline batch generation on top of LLMEngine, mirroring vLLM's `LLM.generate` and
`LLM.chat`, and `LLM.embed` (embeddings pooled from the final hidden states) as vLLM's.

Lifecycle: `shutdown()` (idempotent) stops the tensor-parallel worker processes and leaves
the torch.distributed group, so that another tensor-parallel LLM may start in this process;
`with LLM(...) as llm:` calls it on leaving. An LLM that is garbage-collected without it does
the same through a finalizer (as vLLM's engine client does), which holds the engine and never
the LLM itself, so it cannot keep the LLM alive.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Metric,
    RequestOutput,
)
from conveyor.pooling_params import PoolingParams
from conveyor.sampling_params import SamplingParams
from conveyor.structured.grammar import check_structured_outputs

PromptType = str | list[int] | dict[str, Any]
# {"role": ..., "content": ...}, see conveyor.engine.tokenizer.chat_messages
Message = dict[str, Any]


class LLM:
    """Generate for many prompts at once with continuous batching.

    Args:
        model: a Hugging Face checkpoint folder; None serves the embedded demo model.
        **kwargs: any EngineConfig field (scheduler, max_num_seqs, max_num_batched_tokens,
            block_size, num_kv_blocks, attention_backend, dtype, seed, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()
        self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave their process group (no-op without
        tensor parallelism, or when called again). generate() and chat() then raise."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _check_running(self) -> None:
        if not self._finalizer.alive:
            raise ValueError("this LLM was shut down; create a new LLM to generate again.")

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges, named as the server's /metrics names them."""
        return self.llm_engine.get_metrics()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tenant: str | Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions; outputs come back in the order of `prompts`.

        Args:
            prompts: a string, a list of token ids, a dict with "prompt" or "prompt_token_ids"
                (and, as in vLLM, optionally "cache_salt": that prompt's
                SamplingParams.cache_salt), or a list of any of these.
            sampling_params: one for every prompt, or a list with one per prompt.
            use_tqdm: show a progress bar.
            tenant: whose requests these are, one for all or one per prompt (None: each
                SamplingParams' `tenant`); tenants share each step's time
                (core/tenant_shares.py).
        Raises:
            ValueError: a malformed prompt or a prompt that can never run. Nothing is queued
                unless every prompt is valid.
        """
        prompt_list, salts = _normalize_prompts(prompts)
        if any(salt is not None for salt in salts):
            sampling_params = _with_salts(sampling_params, salts)
        if tenant is not None:
            sampling_params = _with_tenants(sampling_params, tenant, len(prompt_list))
        return self._generate(prompt_list, self._token_ids(prompt_list), sampling_params, use_tqdm)

    def _token_ids(self, prompt_list: list[str | list[int]]) -> list[list[int]]:
        """Each prompt as token ids (text encoded by the engine's tokenizer)."""
        tokenizer = self.llm_engine.tokenizer
        return [p if isinstance(p, list) else tokenizer.encode(p) for p in prompt_list]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embed prompts (vLLM's `LLM.embed`): each prompt's final hidden states pooled as
        the model pools them (its sentence-transformers config, else the last token; see
        EngineConfig.pooling_type) and L2-normalized; `output.outputs.embedding` is the vector.

        Args:
            prompts: as for `generate`.
            pooling_params: one for every prompt, or one per prompt (pooling_type None: the
                model's; dimensions only for Matryoshka models).
            use_tqdm: show a progress bar.
        Raises:
            ValueError: a malformed prompt, one longer than the context, or a pooling the
                model cannot give. Nothing is queued unless every prompt is valid.
        """
        prompt_list, salts = _normalize_prompts(prompts)
        pooling_list = _one_per_prompt(
            pooling_params, PoolingParams, len(prompt_list), "pooling_params"
        )
        for pooling in pooling_list:
            self.llm_engine.pooling.check_request(pooling.dimensions)
        params = [
            SamplingParams(max_tokens=1, pooling=pooling, cache_salt=salt)
            for pooling, salt in zip(pooling_list, salts, strict=True)
        ]
        results = []
        for out in self._generate(prompt_list, self._token_ids(prompt_list), params, use_tqdm):
            if out.embedding is None:  # the engine failed it (out.error says why)
                raise RuntimeError(f"embedding request {out.request_id} failed: {out.error}")
            results.append(
                EmbeddingRequestOutput(
                    out.request_id, EmbeddingOutput(out.embedding), out.prompt_token_ids
                )
            )
        return results

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the tokenizer's chat template, as
        the server's /v1/chat/completions renders them; like `generate` otherwise.

        Args:
            messages: one conversation ([{"role": ..., "content": ...}, ...]) or a list of
                them. Role `developer` is rendered as `system`.
            sampling_params: one for every conversation, or a list with one per conversation.
            use_tqdm: show a progress bar.
            chat_template_kwargs: extra variables for the template.
            add_generation_prompt: end each prompt with the assistant turn's header.
        Returns:
            One RequestOutput per conversation, in order; `prompt` is the rendered text.
        Raises:
            ValueError: a malformed message (named), no chat template, or a prompt that can
                never run. Nothing is queued unless every conversation is valid.
        """
        many = isinstance(messages, (list, tuple)) and bool(messages)
        many = many and all(isinstance(c, (list, tuple)) for c in messages)
        conversations = list(messages) if many else [messages]
        tokenizer = self.llm_engine.tokenizer
        token_prompts = [
            tokenizer.apply_chat_template(
                c, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
            for c in conversations
        ]
        texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in token_prompts]
        return self._generate(texts, token_prompts, sampling_params, use_tqdm)

    def _generate(
        self,
        prompt_list: list[str | list[int]],
        token_prompts: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """Check every prompt, then queue them all and run them to the end."""
        self._check_running()
        params_list = _one_per_prompt(
            sampling_params, SamplingParams, len(prompt_list), "sampling_params"
        )
        engine = self.llm_engine
        # Check everything first so a bad prompt queues nothing.
        for ids, params in zip(token_prompts, params_list, strict=True):
            engine.check_prompt(ids, params)
        constraints = {p.structured_outputs.key: p.structured_outputs for p in params_list
                       if p.structured_outputs is not None}  # fmt: skip
        for so in constraints.values():
            check_structured_outputs(so)  # a schema that cannot compile is a ValueError here

        request_ids = []
        for text, ids, params in zip(prompt_list, token_prompts, params_list, strict=True):
            rid = str(next(self._ids))
            engine.add_request(rid, text, params, prompt_token_ids=ids)
            request_ids.append(rid)
        return self._run(request_ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        num_out = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        num_out += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"{num_out} output tokens", refresh=False)
        except BaseException:
            engine.abort_request(request_ids)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]


def _normalize_prompts(prompts: Any) -> tuple[list[str | list[int]], list[str | None]]:
    """The prompts as text or token ids, and each one's cache_salt (None: its params')."""
    single = isinstance(prompts, (str, dict))
    token_list = isinstance(prompts, list) and bool(prompts) and all(map(_is_token, prompts))
    if single or token_list:
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            "prompts must be a string, a list of token ids, a dict with 'prompt' or "
            f"'prompt_token_ids', or a list of these; got {type(prompts).__name__}."
        )
    salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
    return [_normalize_one(p) for p in prompts], salts


def _one_per_prompt(given: Any, kind: type, n: int, name: str) -> list:
    """The argument `name`, `given` (None: kind's defaults; one `kind`; or one per prompt),
    as a list of n.

    Raises:
        ValueError: a list whose length is not n.
    """
    if given is None or isinstance(given, kind):
        return [given or kind()] * n
    out = list(given)
    if len(out) != n:
        raise ValueError(
            f"Got {len(out)} {name} for {n} prompts: give one {kind.__name__} or one per prompt."
        )
    return out


def _with_salts(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, salts: list[str | None]
) -> list[SamplingParams]:
    """One SamplingParams per prompt, with the prompt's own cache_salt where it has one."""
    params = _one_per_prompt(sampling_params, SamplingParams, len(salts), "sampling_params")
    pairs = zip(params, salts, strict=True)
    return [p if s is None else dataclasses.replace(p, cache_salt=s) for p, s in pairs]


def _with_tenants(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    tenant: str | Sequence[str],
    num_prompts: int,
) -> list[SamplingParams]:
    """One SamplingParams per prompt, each with its prompt's tenant."""
    params = _one_per_prompt(sampling_params, SamplingParams, num_prompts, "sampling_params")
    tenants = _one_per_prompt(tenant, str, num_prompts, "tenant")
    return [dataclasses.replace(p, tenant=t) for p, t in zip(params, tenants, strict=True)]


def _normalize_one(p: Any) -> str | list[int]:
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            p = p["prompt_token_ids"]
        elif "prompt" in p:
            p = p["prompt"]
        else:
            raise ValueError("A dict prompt needs a 'prompt' or 'prompt_token_ids' key.")
    if isinstance(p, str):
        return p
    if isinstance(p, (list, tuple)) and all(_is_token(t) for t in p):
        return list(p)
    raise ValueError(f"Each prompt must be a string or a list of token ids; got {p!r:.80}.")


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
