"""POST /v1/responses' request, and how it maps onto a chat completion request.

A Responses request is a chat request in other clothes; `to_chat_request` rewrites it into a
ChatCompletionRequest, which then takes the one chat path (server/chat.py's `prepare_chat`:
the chat template, tool parsing, the reasoning parser, structured outputs):

    instructions                     a system message before everything else
    input (a string)                 one user message
    input items                      message items (user, system, developer, assistant; content
                                     a string or input_text / output_text parts) as messages;
                                     function_call items as the assistant message's tool_calls;
                                     function_call_output items as `tool` messages; reasoning
                                     items are dropped (templates drop old thinking too)
    tools ({"type": "function", "name", "parameters", ...})   chat's nested tools
    tool_choice {"type": "function", "name": F}                chat's named function
    text.format (text, json_object, json_schema)              response_format
    text.verbosity, reasoning.effort                          verbosity, reasoning_effort
    max_output_tokens                                         max_completion_tokens

Every field is honoured, an accepted no-op hint or refused with a 400 naming it, as on the
other endpoints (server/request_fields.py's RESPONSES_REFUSED and RESPONSES_HINTS;
tests/test_responses_api.py audits them against the openai SDK's parameters).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, ValidationError

from conveyor.server.errors import APIError
from conveyor.server.protocol import Bool, ChatCompletionRequest, Float, Int, OpenAIModel
from conveyor.server.request_fields import RESPONSES_REFUSED, check_refused

# A chat request's field -> the Responses field it came from (for the `param` of a 400).
CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning",
    "verbosity": "text",
}
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")


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
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
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
        """The refused fields (400 naming the first one that asks for something)."""
        check_refused(self, RESPONSES_REFUSED)
        if self.input is None or self.input == []:
            raise APIError("input is required (a string or a list of input items).", "input")


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


def input_messages(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Chat messages of a Responses `input` (the module docstring)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value or ()):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise APIError(
                    f"{where}.role must be one of {_MESSAGE_ROLES}, got {role!r}.", "input"
                )
            messages.append(
                {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            )
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": content,
                }
            )
        elif kind != "reasoning":
            raise APIError(
                f"{where} is a {kind!r} item: this server takes message, function_call, "
                "function_call_output and reasoning items.",
                param="input",
            )
    return messages


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(f"{where}.{key} must be a string.", param="input")
    return value


def _text(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content: a string, or its text parts as chat's text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of parts.", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if kind else None
        if kind not in (*_TEXT_PARTS, "refusal") or not isinstance(text, str):
            raise APIError(
                f"{where}[{j}] is a {str(kind)[:40]!r} part: this server takes text "
                "parts only (input_text, output_text).",
                param="input",
            )
        parts.append({"type": "text", "text": text})
    return parts


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
            out.append(tool)
            continue
        keys = ("name", "description", "parameters", "strict")
        out.append({"type": "function", "function": {k: tool[k] for k in keys if k in tool}})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
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
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise APIError(f"text.{sorted(unknown)[0]} is not supported.", param="text")
    fmt = text.get("format")
    out: dict[str, Any] = {"verbosity": text.get("verbosity")}
    if fmt is None:
        return out
    kind = fmt.get("type") if isinstance(fmt, dict) else None
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
    asked = {k for k, v in reasoning.items() if v is not None and k != "effort"}
    if asked:
        raise APIError(
            f"reasoning.{sorted(asked)[0]} is not supported: this server takes reasoning.effort "
            "only (a reasoning model's thinking comes back whole as a reasoning item).",
            param="reasoning",
        )
    return {"reasoning_effort": reasoning.get("effort")}
