"""POST /v1/responses' request, and how it maps onto a chat completion request.

A Responses request is a chat request in other clothes; `to_chat_request` rewrites it into a
ChatCompletionRequest, which then takes the one chat path (server/chat.py's `prepare_chat`:
the chat template, tool parsing, the reasoning parser, structured outputs):

    instructions                     a system message before everything else
    input (a string)                 one user message
    input items                      chat messages (server/responses_input.py)
    tools ({"type": "function", "name", "parameters", ...})   chat's nested tools
    tool_choice {"type": "function", "name": F}                chat's named function
    text.format (text, json_object, json_schema)              response_format
    text.verbosity, reasoning.effort                          verbosity, reasoning_effort
    max_output_tokens                                         max_completion_tokens

Every field is honoured, an accepted no-op hint or refused with a 400 naming it, as on the
other endpoints (server/request_fields.py's RESPONSES_REFUSED and RESPONSES_HINTS;
tests/server/test_responses_api.py audits them against the openai SDK's parameters). What a stored
response echoes is bounded too: a key OpenAI does not define in `reasoning`, `text`,
`text.format`, a tool, `tool_choice` or `stream_options` is a 400 naming it, `metadata` is
chat's (16 pairs, keys 64 and values 512 characters), `safety_identifier` OpenAI's 64
characters, `user` and `prompt_cache_key` MAX_HINT_CHARS.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from conveyor.server.errors import APIError
from conveyor.server.protocol import (
    Bool,
    ChatCompletionRequest,
    Float,
    Int,
    Metadata,
    OpenAIModel,
)
from conveyor.server.request_fields import RESPONSES_REFUSED, check_refused
from conveyor.server.responses_input import input_messages

# A chat request's field -> the Responses field it came from (for the `param` of a 400).
CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning",
    "verbosity": "text",
}
# The keys OpenAI defines for each object a response echoes.
_REASONING_KEYS = ("effort", "summary", "generate_summary")
_TEXT_KEYS = ("format", "verbosity")
_FORMAT_KEYS = {"text": ("type",), "json_object": ("type",),
                "json_schema": ("type", "name", "schema", "strict", "description")}  # fmt: skip
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_TOOL_CHOICE_KEYS = ("type", "name")
_STREAM_OPTIONS_KEYS = ("include_obfuscation",)
# `user` and `prompt_cache_key` (OpenAI states no bound; safety_identifier's is 64).
MAX_HINT_CHARS = 256


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses (stateless unless `store`: see server/responses_api.py). Unknown
    fields are refused (a 400 naming the field)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: Bool | None = False
    store: Bool | None = True
    previous_response_id: str | None = None
    cache_salt: str | None = None  # vLLM's, as on the other endpoints (server/tenancy.py)
    # OpenAI's hints, accepted and type-checked, changing nothing (RESPONSES_HINTS).
    metadata: Metadata | None = None
    user: Annotated[str, Field(max_length=MAX_HINT_CHARS)] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: Annotated[str, Field(max_length=MAX_HINT_CHARS)] | None = None
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None
    max_tool_calls: Int | None = None  # caps built-in tools' calls: this server has none
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no padding is sent
    # Refused unless they ask for nothing (RESPONSES_REFUSED).
    background: Bool | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: Int | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    context_management: list[Any] | dict[str, Any] | None = None
    image: dict[str, Any] | None = None

    def check(self) -> None:
        """The refused fields (400 naming the first one that asks for something), and the
        keys of the objects only echoed back."""
        check_refused(self, RESPONSES_REFUSED)
        if self.input is None or self.input == []:
            raise APIError("input is required (a string or a list of input items).", "input")
        if self.stream_options is not None:
            known_keys(self.stream_options, _STREAM_OPTIONS_KEYS, "stream_options")
            obfuscation = self.stream_options.get("include_obfuscation")
            if obfuscation is not None and not isinstance(obfuscation, bool):
                raise APIError(
                    "stream_options.include_obfuscation must be true or false.", "stream_options"
                )

    def echoed_reasoning(self) -> dict[str, Any]:
        """`reasoning` as the response object shows it (its keys checked by to_chat_request)."""
        reasoning = self.reasoning or {}
        return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request that answers `req`.

    Args:
        history: the messages of the conversation `previous_response_id` continues (its
            inputs and outputs, without their instructions: OpenAI does not carry them over).
    Raises:
        APIError: an item, tool, tool_choice, text or reasoning this server cannot map
            (400 naming the field).
    """
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += history + input_messages(req.input)
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": _chat_tools(req.tools),
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "cache_salt": req.cache_salt,
        **_text_fields(req.text),
        **_reasoning_fields(req.reasoning),
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(p) for p in error.get("loc", ())]
        param = CHAT_TO_RESPONSES.get(loc[0], loc[0]) if loc else None
        raise APIError(f"{'.'.join(loc) or 'body'}: {error.get('msg')}", param=param) from None


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's nested ones."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(
                f"tools[{i}] is a {str(kind)[:40]!r} tool: this server runs function tools "
                'only ({"type": "function", "name": ..., "parameters": ...}).',
                param="tools",
            )
        if "function" in tool and "name" not in tool:  # chat's shape: taken as it is
            known_keys(tool, ("type", "function"), "tools", f"tools[{i}]")
            if isinstance(tool["function"], dict):
                known_keys(tool["function"], _FUNCTION_KEYS, "tools", f"tools[{i}].function")
            out.append(tool)
            continue
        known_keys(tool, ("type", *_FUNCTION_KEYS), "tools", f"tools[{i}]")
        function = {k: tool[k] for k in _FUNCTION_KEYS if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        known_keys(choice, _TOOL_CHOICE_KEYS, "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        f'tool_choice must be "none", "auto", "required" or {{"type": "function", "name": ...}}, '
        f"got {json.dumps(choice)[:100]}.",
        param="tool_choice",
    )


def _text_fields(text: dict[str, Any] | None) -> dict[str, Any]:
    """`text` ({"format": ..., "verbosity": ...}) as chat's response_format and verbosity."""
    if not text:
        return {}
    known_keys(text, _TEXT_KEYS, "text")
    fmt = text.get("format")
    out: dict[str, Any] = {"verbosity": text.get("verbosity")}
    if fmt is None:
        return out
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in _FORMAT_KEYS:
        known_keys(fmt, _FORMAT_KEYS[kind], "text", "text.format")
    if kind == "json_schema":
        keys = ("name", "schema", "strict", "description")
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {k: fmt[k] for k in keys if k in fmt},
        }
    elif kind in ("text", "json_object"):
        out["response_format"] = {"type": kind}
    else:
        raise APIError(
            f'text.format.type must be "text", "json_object" or "json_schema", got {kind!r:.40}.',
            param="text",
        )
    return out


def _reasoning_fields(reasoning: dict[str, Any] | None) -> dict[str, Any]:
    """`reasoning.effort` as chat's reasoning_effort (passed to a template that reads it);
    a summary is refused: the thinking comes back whole, as a reasoning item."""
    if not reasoning:
        return {}
    known_keys(reasoning, _REASONING_KEYS, "reasoning")
    asked = {k for k, v in reasoning.items() if v is not None and k != "effort"}
    if asked:
        raise APIError(
            f"reasoning.{sorted(asked)[0]} is not supported: this server takes reasoning.effort "
            "only (a reasoning model's thinking comes back whole as a reasoning item).",
            param="reasoning",
        )
    return {"reasoning_effort": reasoning.get("effort")}


def known_keys(value: dict[str, Any], known: tuple[str, ...], param: str, where: str = "") -> None:
    """400 (param `param`) naming the first keys of `value` that are not in `known`.

    Args:
        where: how the message calls the object (default: `param`).
    """
    unknown = [k for k in value if k not in known]
    if not unknown:
        return
    where = where or param
    named = ", ".join(f"{where}.{str(k)[:40]}" for k in unknown[:3])
    more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
    raise APIError(
        f"{named}{more}: unrecognized argument{'s' if len(unknown) > 1 else ''} ({where} "
        f"takes {', '.join(known)}).",
        param=param,
    )
