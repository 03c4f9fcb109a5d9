"""ServingContext: what every endpoint shares (the engine, the served name) and their checks.

Text is refused before it is tokenized when it is longer than `MAX_CHARS_PER_TOKEN`
characters per token of the model's context: no text that long fits. Tokenizers average 3-5
characters per token on prose and code; only text made mostly of one long repeated run could
exceed 32, and it would not fit in far fewer characters either. Chat messages count the same
way, each with a token's worth of characters for its header (chat_template.py's docstring).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from conveyor.entrypoints.async_llm import AsyncLLM, PromptError
from conveyor.sampling_params import SamplingParams
from conveyor.server.chat_template import check_message_count, template_chars, template_messages
from conveyor.server.chat_template import template_kwargs as checked_template_kwargs
from conveyor.server.errors import APIError
from conveyor.server.offload import INLINE_CHARS, maybe_off_loop, off_loop, text_pool
from conveyor.server.protocol import ChatMessage
from conveyor.server.reasoning import ReasoningParser, thinking_disabled
from conveyor.server.request_fields import add_template_fields
from conveyor.server.tool_fallback import fallback_messages
from conveyor.server.tool_parsers import detect_tool_format
from conveyor.server.tools import ToolSetup
from conveyor.structured.grammar_checker import GrammarChecker

MAX_CHARS_PER_TOKEN = 32


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
    max_prompts: the most prompts one completions request may hold (None: no cap).
    trust_request_chat_template: requests may bring their own chat template.
    tool_call_parser: the tool-call format (server/tool_parsers.py; None: the chat
        template's, `detect_tool_format`).
    reasoning_parser: how chat answers' thinking is split off (server/reasoning.py; None:
        no split), chosen at start-up from --reasoning-parser or the tokenizer's template.
    grammars: checks output constraints in a worker process (structured/grammar_checker.py);
        None: in this process, unbounded (LLM-only use).
    max_chat_messages: the most messages one chat request may hold (None: no cap).
    """

    engine: AsyncLLM
    model_name: str
    model_path: str | None = None
    max_n: int | None = None
    request_timeout: float | None = None
    aliases: tuple[str, ...] = ()
    max_prompts: int | None = None
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: ReasoningParser | None = None
    grammars: GrammarChecker | None = None
    max_chat_messages: int | None = None

    @property
    def served_names(self) -> list[str]:
        """Every name this server answers to, the reported one first."""
        return list(dict.fromkeys((self.model_name, *self.aliases)))

    def check_size(self, n: int, num_prompts: int = 1) -> None:
        """400 for a request larger than this server ever admits (checked before any of its
        text is tokenized).

        Raises:
            APIError: n above max_n, more prompts than max_prompts, or more sequences
                (prompts x n) than max_waiting_requests lets wait at once.
        """
        if self.max_n is not None and n > self.max_n:
            raise APIError(f"n must be at most {self.max_n} on this server, got {n}.", param="n")
        if self.max_prompts is not None and num_prompts > self.max_prompts:
            raise APIError(
                f"prompt must hold at most {self.max_prompts} prompts on this server, "
                f"got {num_prompts}.",
                param="prompt",
            )
        cap, num_seqs = self.engine.max_waiting_requests, n * num_prompts
        if num_seqs > cap:
            raise APIError(
                f"This request asks for {num_seqs} sequences ({num_prompts} prompt(s) x n={n}), "
                f"more than this server lets wait at once ({cap}); send fewer prompts or a "
                "smaller n.",
                param="n" if num_prompts == 1 else "prompt",
            )

    def admit(self, n: int, num_prompts: int = 1) -> None:
        """Admission before anything is queued: APIError (400) over the server's caps,
        EngineOverloadedError (503 with Retry-After) while the waiting queue is full."""
        self.check_size(n, num_prompts)
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

    def check_text_length(self, num_chars: int, what: str, num_messages: int = 0) -> None:
        """400 for text too long for the model's context in any tokenization (see the module
        docstring), before it is tokenized; each of `num_messages` adds a token's worth."""
        limit = self.engine.max_model_len
        most = limit * MAX_CHARS_PER_TOKEN
        counted = num_chars + num_messages * MAX_CHARS_PER_TOKEN
        if counted <= most:
            return
        has = f"has {num_chars} characters"
        if num_messages:
            has = (
                f"have {num_chars} characters (text, tools and template variables) in "
                f"{num_messages} messages, {counted} with {MAX_CHARS_PER_TOKEN} for each "
                "message's header"
            )
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, your {what} "
            f"{has}, more than {limit} tokens can hold (at most {most}: "
            f"{MAX_CHARS_PER_TOKEN} per token), so it was not tokenized.",
            param=what,
        )

    async def tokenize_prompt(
        self, prompt: str | list[int], add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of a text or token-id prompt (check_fits rejects an empty one); long text
        is tokenized off the event loop, text too long for the context is an APIError."""
        if not isinstance(prompt, str):
            return prompt
        self.check_text_length(len(prompt), "prompt")
        encode = self.engine.tokenizer.encode
        return await maybe_off_loop(len(prompt), INLINE_CHARS, encode, prompt, add_special_tokens)

    def tool_format(self, chat_template: str | None = None) -> str:
        """The tool-call format of a request: --tool-call-parser's, else the one its chat
        template (the request's own, or the tokenizer's) teaches."""
        if self.tool_call_parser is not None:
            return self.tool_call_parser
        if chat_template is None:
            chat_template = self.engine.tokenizer.chat_template_text
        return detect_tool_format(chat_template)

    def reasoning(
        self, template_kwargs: dict[str, Any] | None, chat_template: str | None = None
    ) -> ReasoningParser | None:
        """The reasoning parser of a chat request: the server's, unless its chat_template_kwargs
        turned thinking off through a variable its template (None: the tokenizer's) reads."""
        if self.reasoning_parser is None:
            return None
        source = chat_template or self.template_source({})
        if thinking_disabled(template_kwargs, source):
            return None
        return self.reasoning_parser

    def check_message_count(self, num_messages: int) -> None:
        """400 for more messages than max_chat_messages, before any is rendered."""
        if self.max_chat_messages is not None:
            check_message_count(num_messages, self.max_chat_messages)

    async def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        fields: dict[str, Any] | None = None,
        tool_setup: ToolSetup | None = None,
    ) -> list[int]:
        """Prompt token ids of chat messages, through the chat template (the tokenizer's, or
        the request's own if the server trusts request templates), rendered off the loop.
        With a template that cannot render tools (the generic tool-call format), the tools
        and the tool calls of the history are written into the messages instead
        (server/tool_fallback.py).

        Args:
            fields: request fields passed as template variables when the template reads
                them (reasoning_effort, verbosity: server/request_fields.py).
            tool_setup: the request's tools (their description, for the generic format).
        Raises:
            APIError: more than max_chat_messages messages, text too long, a refused template
                or template variable, a field the template does not read, no template, or the
                template failed on these messages.
        """
        self.check_message_count(len(messages))
        kwargs = checked_template_kwargs(
            template_kwargs, chat_template, self.trust_request_chat_template
        )
        if fields:
            add_template_fields(fields, self.template_source(kwargs), kwargs)
        dumped = template_messages(messages)
        template = kwargs.get("chat_template")
        if self.tool_format(template if isinstance(template, str) else None) == "generic":
            prompt = tool_setup.system_prompt() if tool_setup is not None else None
            dumped = fallback_messages(dumped, prompt)
        elif tools:
            kwargs["tools"] = tools
        own = kwargs.get("chat_template")
        variables = {k: v for k, v in kwargs.items() if k != "chat_template"}
        size = template_chars(dumped, variables)
        self.check_text_length(size, "messages", len(dumped))
        tokenizer = self.engine.tokenizer
        if not tokenizer.has_chat_template and "chat_template" not in kwargs:
            raise APIError(
                "This model has no chat template; use /v1/completions with a plain prompt.",
                param="messages",
            )
        try:
            # A request's own template may cost anything: the heavy lane, whatever its size.
            pool = text_pool(None if own else size + len(dumped) * MAX_CHARS_PER_TOKEN)
            # Bound first: a template variable may be called `fn` or `pool`, like off_loop's own.
            render = functools.partial(
                tokenizer.apply_chat_template,
                dumped,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
            return await off_loop(render, pool=pool)
        except ValueError as exc:  # a malformed message, or the template refused them
            raise APIError(str(exc), param="messages") from exc
        except Exception as exc:  # anything else the template raised while rendering
            message = f"The chat template failed on these messages: {exc}"
            raise APIError(message, param="messages") from exc

    def truncated(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as the
        context holds; None: the whole prompt).

        Raises:
            APIError: `keep` is 0, below -1 or above the model's context (400).
        """
        if keep is None:
            return prompt_ids
        limit = self.engine.max_model_len
        if keep == -1:
            keep = limit
        if not 1 <= keep <= limit:
            raise APIError(
                f"truncate_prompt_tokens must be -1 (the model's context) or in [1, {limit}], "
                f"got {keep}.",
                param="truncate_prompt_tokens",
            )
        return prompt_ids[-keep:]

    def template_source(self, kwargs: dict[str, Any]) -> str:
        """The text of the chat template a request renders with: its own (kwargs'
        `chat_template`, once checked) or the tokenizer's (all of them, if it has several)."""
        source = kwargs.get("chat_template") or getattr(
            self.engine.tokenizer.hf, "chat_template", None
        )
        if isinstance(source, dict):
            return "\n".join(str(v) for v in source.values())
        return source if isinstance(source, str) else ""

    def check_fits(self, prompt_ids: list[int], params: SamplingParams, what: str) -> None:
        """400 unless the prompt can run: the engine's check with strict=True, so a max_tokens
        beyond the model's context is refused (as in vLLM), not clamped. `what` ("prompt" or
        "messages") is the `param` of an error about the prompt."""
        try:
            self.engine.check_prompt(prompt_ids, params, strict=True)
        except PromptError as exc:
            param = what if exc.param == "prompt" else exc.param
            raise APIError(str(exc), param=param) from exc
