"""ServingContext: what every endpoint shares (the engine, the served name) and their checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from conveyor.entrypoints.async_llm import AsyncLLM, PromptError
from conveyor.sampling_params import SamplingParams
from conveyor.server.errors import APIError
from conveyor.server.protocol import ChatMessage


@dataclass(slots=True)
class ServingContext:
    """Args:
    engine: the running AsyncLLM.
    model_name: the name responses report; clients send it, an alias, or nothing.
    model_path: reported as the model's `root` in /v1/models.
    max_n: the largest `n` a request may ask for (None: no cap).
    request_timeout: seconds after which any request ends with "abort" (None: only its own
        `deadline`, if any).
    aliases: further names requests may use (listed in /v1/models after model_name).
    """

    engine: AsyncLLM
    model_name: str
    model_path: str | None = None
    max_n: int | None = None
    request_timeout: float | None = None
    aliases: tuple[str, ...] = ()

    @property
    def served_names(self) -> list[str]:
        """Every name this server answers to, the reported one first."""
        return list(dict.fromkeys((self.model_name, *self.aliases)))

    def admit(self, n: int, num_prompts: int = 1) -> None:
        """Admission control before anything is queued.

        Raises:
            APIError: n above the server's cap (400).
            EngineOverloadedError: the waiting queue is full (503 with Retry-After).
        """
        if self.max_n is not None and n > self.max_n:
            raise APIError(f"n must be at most {self.max_n} on this server, got {n}.", param="n")
        self.engine.check_admission(n * num_prompts)

    def with_timeout(self, params: SamplingParams) -> SamplingParams:
        """The request's deadline capped by the server's request_timeout."""
        timeout = self.request_timeout
        if timeout is None or (params.deadline is not None and params.deadline <= timeout):
            return params
        return dataclasses.replace(params, deadline=timeout)

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is a served name (None means the served model, as in vLLM); the
        message lists the names that exist."""
        names = self.served_names
        if model is not None and model not in names:
            served = ", ".join(f"`{n}`" for n in names)
            raise APIError(
                f"The model `{model}` does not exist. This server serves: {served}.",
                param="model",
                status=404,
            )

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text or token-id prompt (check_fits rejects an empty one)."""
        return self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Prompt token ids of chat messages, through the tokenizer's chat template."""
        tokenizer = self.engine.tokenizer
        if not tokenizer.has_chat_template:
            raise APIError(
                "This model has no chat template; use /v1/completions with a plain prompt.",
                param="messages",
            )
        try:
            return tokenizer.apply_chat_template(
                [m.for_template() for m in messages],
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
        except ValueError as exc:  # a malformed message, or the template refused them
            raise APIError(str(exc), param="messages") from exc
        except Exception as exc:  # anything else the template raised while rendering
            message = f"The chat template failed on these messages: {exc}"
            raise APIError(message, param="messages") from exc

    def check_fits(self, prompt_ids: list[int], params: SamplingParams, what: str) -> None:
        """400 unless the prompt can run: the engine's check with strict=True, so a max_tokens
        beyond the model's context is refused (as in vLLM), not clamped.

        Args:
            prompt_ids: the prompt.
            params: the request's sampling parameters (max_tokens as requested).
            what: "prompt" or "messages": the `param` of an error about the prompt.
        """
        try:
            self.engine.check_prompt(prompt_ids, params, strict=True)
        except PromptError as exc:
            param = what if exc.param == "prompt" else exc.param
            raise APIError(str(exc), param=param) from exc
