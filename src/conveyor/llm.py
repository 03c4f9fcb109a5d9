"""LLM: offline batch generation on top of LLMEngine, mirroring vLLM's `LLM.generate`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from conveyor.config import EngineConfig
from conveyor.engine import LLMEngine
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


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

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions; outputs come back in the order of `prompts`.

        Args:
            prompts: a string, a list of token ids, a dict with "prompt" or "prompt_token_ids",
                or a list of any of these.
            sampling_params: one for every prompt, or a list with one per prompt.
            use_tqdm: show a progress bar.
        Raises:
            ValueError: a malformed prompt or a prompt that can never run. Nothing is queued
                unless every prompt is valid.
        """
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"Got {len(params_list)} sampling_params for {len(prompt_list)} prompts: "
                    "give one SamplingParams or one per prompt."
                )
        engine = self.llm_engine
        # Tokenize and check everything first so a bad prompt queues nothing.
        token_prompts = [
            p if isinstance(p, list) else engine.tokenizer.encode(p) for p in prompt_list
        ]
        for ids, params in zip(token_prompts, params_list, strict=True):
            engine.check_prompt(ids, params)

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


def _normalize_prompts(prompts: Any) -> list[str | list[int]]:
    single = isinstance(prompts, (str, dict))
    token_list = isinstance(prompts, list) and bool(prompts) and all(map(_is_token, prompts))
    if single or token_list:
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            "prompts must be a string, a list of token ids, a dict with 'prompt' or "
            f"'prompt_token_ids', or a list of these; got {type(prompts).__name__}."
        )
    return [_normalize_one(p) for p in prompts]


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
