"""A Responses request's `input` items as chat messages (server/responses_protocol.py):
message items (user, system, developer, assistant; content a string or input_text /
output_text parts) as messages, function_call items as the assistant message's tool_calls,
function_call_output items as `tool` messages; reasoning items are dropped (templates drop
old thinking too).
"""

from __future__ import annotations

from typing import Any

from conveyor.server.errors import APIError

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")


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
