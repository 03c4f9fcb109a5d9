"""Pydantic models of the OpenAI-compatible requests (responses are in server/responses.py).

Fields and defaults follow the OpenAI API plus vLLM's extensions (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, min_tokens, priority, allowed_token_ids,
bad_words, truncate_prompt_tokens, ...) and conveyor's scheduling fields (deadline,
length_hint). Every declared field is honoured, an accepted no-op hint or refused with a 400
(server/request_fields.py, checked field by field by tests/server/test_request_fields.py). Unknown
fields are ignored, as vLLM does. Numbers and booleans are strict (`"max_tokens": "5"` or
`true` is a 400, not silently coerced). `null` means "the default" everywhere. Ranges are
checked once, by SamplingParams, whose ValueError names the field; `to_sampling_params`
turns it into a 400.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from conveyor.sampling_params import SamplingParams
from conveyor.server.errors import APIError
from conveyor.server.request_fields import CHAT_REFUSED, REFUSED, check_refused
from conveyor.server.unicode import find_lone_surrogate

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]

# A logit_bias key: a token id in ASCII digits (no vocabulary reaches 10 digits).
_MAX_TOKEN_ID_DIGITS = 10
_TOKEN_ID_KEY = re.compile(rf"[0-9]{{1,{_MAX_TOKEN_ID_DIGITS}}}")


def _check_strict(value: Any, where: str) -> None:
    """OpenAI's `strict` flags are booleans: `"strict": "yes"` is a 400, not truthy."""
    if value is not None and not isinstance(value, bool):
        raise PydanticCustomError(
            "strict_bool", "{where} must be true or false, got {value}",
            {"where": where, "value": repr(value)[:40]},
        )  # fmt: skip


# Unknown fields a body may have before they are refused in one error, not one each.
_MANY_UNKNOWN = 16


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _many_unknown_fields(cls, value: Any) -> Any:
        """A request model that refuses unknown fields refuses many of them in one error:
        pydantic builds one error each: seconds on the event loop and hundreds of MB for a
        body of many keys (docs/benchmarks.md#responses-store-attacks)."""
        if (
            isinstance(value, dict)
            and len(value) > len(cls.model_fields) + _MANY_UNKNOWN
            and cls.model_config.get("extra") == "forbid"
        ):
            unknown = [k for k in value if k not in cls.model_fields]
            raise PydanticCustomError(
                "extra_forbidden_many",
                "{count} unrecognized request arguments (this server does not know or honour "
                "them), among them {first}",
                {"count": len(unknown), "first": ", ".join(repr(k)[:40] for k in unknown[:3])},
            )
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """JSON's `\\udfff` escapes decode to lone surrogates, which no tokenizer takes and no
        UTF-8 answer can echo: such a field is a 400 naming it."""
        where = find_lone_surrogate(value)
        if where is not None:
            raise PydanticCustomError(
                "lone_surrogate",
                "a string{where} holds a lone UTF-16 surrogate ({char}), which is not valid "
                "Unicode text",
                {"where": where[0], "char": where[1]},
            )
        return value


# OpenAI's metadata: at most 16 pairs of strings, keys up to 64 and values up to 512 characters.
_MAX_METADATA = (16, 64, 512)


def _metadata_size(value: dict[str, str]) -> dict[str, str]:
    pairs, key_chars, value_chars = _MAX_METADATA
    if len(value) > pairs or any(
        len(k) > key_chars or len(v) > value_chars for k, v in value.items()
    ):
        raise PydanticCustomError(
            "metadata_size",
            "metadata holds at most {pairs} pairs, keys of at most {key_chars} and values "
            "of at most {value_chars} characters",
            {"pairs": pairs, "key_chars": key_chars, "value_chars": value_chars},
        )
    return value


# `metadata` on chat and /v1/responses, one rule for both.
Metadata = Annotated[dict[str, str], AfterValidator(_metadata_size)]

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class StreamOptions(OpenAIModel):
    include_usage: Bool | None = False
    continuous_usage_stats: Bool | None = False


class _GenerationRequest(OpenAIModel):
    """Fields shared by completions and chat completions. Unknown fields are refused (a 400
    naming the field): a field this server does not know is one it would not honour."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: Int | None = None
    n: Int | None = 1
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: Bool | None = False
    min_tokens: Int | None = 0
    include_stop_str_in_output: Bool | None = False
    skip_special_tokens: Bool | None = True
    priority: Int | None = 0
    deadline: Float | None = None  # seconds from arrival; then finish_reason "abort"
    length_hint: Int | None = None  # expected output tokens, for the sjf-family schedulers
    user: str | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    best_of: Int | None = None
    # Output constraints (server/constraints.py turns them into StructuredOutputsParams).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    prompt_logprobs: Int | None = None  # completions only (chat refuses it in check_chat)
    # vLLM's: requests with different salts share no prefix-cache blocks. A server with
    # --cache-salt-from combines it with the tenant's own salt (server/tenancy.py).
    cache_salt: str | None = None
    # vLLM's token masks (SamplingParams) and prompt truncation (the last N prompt tokens).
    allowed_token_ids: list[Int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Int | None = None
    # vLLM's, refused unless they ask for nothing (server/request_fields.py's REFUSED).
    use_beam_search: Bool | None = False
    length_penalty: Float | None = None
    spaces_between_special_tokens: Bool | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: Bool | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: Any = None
    return_token_ids: Bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _strict_schema_flag(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        spec = value.get("json_schema") if value else None
        if isinstance(spec, dict):
            _check_strict(spec.get("strict"), "json_schema.strict")
        return value

    def check_common(self) -> None:
        """Checks that SamplingParams cannot make (they involve the request as a whole)."""
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError("best_of is not supported: leave it unset or equal to n.", "best_of")
        check_refused(self, REFUSED)

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys (strings): ASCII decimal digits only
        (`str.isdigit` also takes "²", which int() refuses), and few enough of them."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise APIError(
                    "logit_bias keys must be token ids (decimal integers >= 0, at most "
                    f"{_MAX_TOKEN_ID_DIGITS} digits), got {key!r:.40}.",
                    param="logit_bias",
                )
            out[int(key)] = bias
        return out

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Build SamplingParams; a range error becomes a 400 naming the field.

        Args:
            max_tokens: the output cap (None: whatever the context leaves).
            logprobs: how many top logprobs per token (None: no logprobs).
        """
        fields: dict[str, Any] = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "priority": self.priority,
            "deadline": self.deadline,
            "length_hint": self.length_hint,
            "logit_bias": self._logit_bias(),
            "prompt_logprobs": self.prompt_logprobs,
            "cache_salt": self.cache_salt,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
        }
        kwargs = {k: v for k, v in fields.items() if v is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            param = field if field in type(self).model_fields else None
            raise APIError(str(exc), param=param) from exc


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: Bool | None = False
    suffix: str | None = None
    add_special_tokens: Bool | None = True  # vLLM's: BOS and the like before a text prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt must not be empty.", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# OpenAI's chat roles; anything else is a 400 rather than text a template prints or drops.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, ... go to the template

    role: Role
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """Images, audio, files: a 400 naming the part, not pydantic's union of mismatches."""
        for j, part in enumerate(value if isinstance(value, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("text", "refusal"):
                raise PydanticCustomError(
                    "unsupported_content_part",
                    "content[{j}] is a '{kind}' part: this server takes text parts only",
                    {"j": j, "kind": kind[:40]},
                )
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as `Tokenizer.apply_chat_template` takes it; that joins text parts and
        maps role `developer` to `system` (`conveyor.engine.tokenizer.chat_messages`).

        As vLLM and transformers pass them: a null or absent content is "" (an assistant
        message with tool_calls has none; templates print `message['content']` as a string),
        and each tool call's `arguments` JSON text is the object it holds (templates render
        it as a mapping, or with `tojson`); an empty tool_calls list is no calls (templates
        test `'tool_calls' in message`).
        """
        out = self.model_dump(exclude_none=True)
        out.setdefault("content", "")
        # Templates read an answer's thinking as `reasoning_content` (Qwen3) or `thinking`
        # (gpt-oss): a client sends back the first (or `reasoning`), so both are given.
        thought = out.get("reasoning_content", out.get("reasoning"))
        if self.role == "assistant" and isinstance(thought, str):
            out.setdefault("thinking", thought)
        calls = out.get("tool_calls")
        if calls == []:  # a plain answer sent back whole (`"tool_calls": []`, as we answer)
            del out["tool_calls"]
        elif isinstance(calls, list):
            out["tool_calls"] = [_template_tool_call(c) for c in calls]
        return out


def _template_tool_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except json.JSONDecodeError:  # not JSON: the template gets the text as it came
        return call
    return {**call, "function": {**fn, "arguments": arguments}}


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    add_generation_prompt: Bool | None = True
    chat_template: str | None = None  # only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None  # false: at most one call (server/tools.py)
    # Passed to a chat template that reads them, else a 400 (server/request_fields.py).
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # OpenAI's hints, accepted and type-checked, changing nothing (NO_OP_HINTS).
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Refused unless they ask for nothing (REFUSED).
    store: Bool | None = None
    audio: dict[str, Any] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    continue_final_message: Bool | None = None
    # vLLM's chat extras, refused unless they ask for nothing (CHAT_REFUSED).
    echo: Bool | None = None
    add_special_tokens: Bool | None = None
    documents: list[Any] | None = None

    @field_validator("tools")
    @classmethod
    def _strict_function_flags(cls, value: list[dict[str, Any]] | None) -> Any:
        for i, tool in enumerate(value or ()):
            fn = tool.get("function")
            if isinstance(fn, dict):
                _check_strict(fn.get("strict"), f"tools[{i}].function.strict")
        return value

    def check_chat(self) -> None:
        """Chat-only checks, before the template is applied."""
        check_refused(self, CHAT_REFUSED)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
        if self.prompt_logprobs is not None:
            raise APIError(
                "prompt_logprobs is supported on /v1/completions only.", param="prompt_logprobs"
            )
        if self.functions:
            raise APIError("functions are not supported: use tools.", param="functions")
        if self.function_call not in (None, "none"):
            raise APIError("function_call is not supported: use tool_choice.", "function_call")


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = True
    add_generation_prompt: Bool | None = True


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[Int]
