"""Tools for a chat template that cannot render them (the "generic" tool-call format).

Many templates never mention tools (SmolLM2's, base and older chat models'), so a request's
tools would never reach the model and "auto" would always answer in text. For those, as
llama.cpp's server does for any model:

    the tools        described in a system message (appended to the request's first system
                     message, or a new one before the others)
    the answer       constrained by the grammar to plain text (not starting with `{` or a
                     blank) or only {"tool_calls": [{"name": ..., "arguments": {...}}]}, each
                     call matching its tool's schema (at most one with parallel_tool_calls
                     false, at least one with tool_choice "required")
    the history      an assistant message's tool_calls become that JSON in its content, and
                     the `tool` messages after it one user message of
                     {"tool_response": {"name", "tool_call_id", "content"}} lines, so a template
                     that knows only system, user and assistant renders a tool loop
"""

from __future__ import annotations

import json
from typing import Any

_INSTRUCTIONS = (
    "You can call the following tools. Each line is one tool: its name, what it does and the "
    "JSON schema of its arguments.\n{tools}\n\n"
    "To call {how}, reply with only a JSON object, nothing before or after it:\n"
    '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<the arguments>}}}}]}}\n'
    "{otherwise}"
    'A tool\'s result comes back in a user message holding {{"tool_response": ...}}.'
)


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def tools_prompt(tools: list[dict[str, Any]], mode: str, parallel: bool, named: str | None) -> str:
    """The system message text that describes `tools` and the JSON envelope of a call."""
    lines = []
    for tool in tools:
        fn = tool["function"]
        entry = {"name": fn["name"]}
        if fn.get("description"):
            entry["description"] = fn["description"]
        entry["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
        lines.append(_compact(entry))
    how = "tools (one or more calls)" if parallel else "a tool (one call)"
    otherwise = "Otherwise reply in plain text. "
    if mode == "required":
        how, otherwise = ("tools" if parallel else "one tool") + " (you must call one)", ""
    elif mode == "named":
        how, otherwise = f"the tool {named} (you must call it)", ""
    return _INSTRUCTIONS.format(tools="\n".join(lines), how=how, otherwise=otherwise)


def envelope_schema(parameters: dict[str, dict[str, Any]], parallel: bool) -> dict:
    """The JSON schema of {"tool_calls": [...]}: each call one tool's name and arguments."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "arguments": schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in parameters.items()
    ]
    one = items[0] if len(items) == 1 else {"anyOf": items}
    calls: dict[str, Any] = {"type": "array", "items": one, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    return {
        "type": "object",
        "properties": {"tool_calls": calls},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _text(content: Any) -> Any:
    """A message's content as text: its text parts joined, as chat templates get them."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _as_content(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with tool_calls as one with them in its content."""
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        calls.append({"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))})
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    text = _text(out.get("content"))
    envelope = json.dumps({"tool_calls": calls}, ensure_ascii=False)
    out["content"] = f"{text}\n{envelope}" if text else envelope
    return out


def fallback_messages(
    messages: list[dict[str, Any]], system_prompt: str | None
) -> list[dict[str, Any]]:
    """`messages` (as ChatMessage.for_template gives them) rendered for a template that knows
    no tools: see the module docstring. `system_prompt` None adds no tool description."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> the function it called
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            for call in message["tool_calls"]:
                if isinstance(call, dict) and isinstance(call.get("function"), dict):
                    names[str(call.get("id"))] = str(call["function"].get("name"))
            out.append(_as_content(message))
        elif role == "tool":
            call_id = str(message.get("tool_call_id"))
            response = {"name": names.get(call_id, message.get("name")), "tool_call_id": call_id,
                        "content": _text(message.get("content"))}  # fmt: skip
            line = json.dumps({"tool_response": response}, ensure_ascii=False)
            if out and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line, "_tool_responses": True})
        else:
            out.append(message)
    for message in out:
        message.pop("_tool_responses", None)
    if system_prompt is None:
        return out
    if (
        out
        and out[0].get("role") in ("system", "developer")
        and isinstance(out[0].get("content"), str)
    ):
        first = out[0]
        out[0] = {**first, "content": f"{first['content']}\n\n{system_prompt}".lstrip()}
        return out
    return [{"role": "system", "content": system_prompt}, *out]
