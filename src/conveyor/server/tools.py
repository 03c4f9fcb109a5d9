"""Tool calling on /v1/chat/completions: `tools` and `tool_choice`, OpenAI's semantics.

    tool_choice "none"       the tools go to the chat template only; the answer is text
    tool_choice "auto"       (the default with tools) the model's own format, parsed after
                             generation by the server's --tool-call-parser
    tool_choice "required"   constrained to a JSON array of {"name", "parameters"} whose items
                             match one tool's schema each: it always parses
    {"type": "function", "function": {"name": F}}   constrained to F's parameters schema

Calls come back as `message.tool_calls` (ids `call-...`); finish_reason is "tool_calls" when
"auto" or "required" produced calls, "stop" for a named function (as vLLM and OpenAI do).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.server.errors import APIError
from conveyor.server.responses import random_id
from conveyor.server.tool_parsers import TOOL_CALL_PARSERS, Parsed, ToolCall
from conveyor.structured_outputs import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ANY_OBJECT = {"type": "object", "properties": {}}


@dataclass(slots=True)
class ToolSetup:
    """The tools of one request and how the answer is read."""

    mode: str  # "none" | "auto" | "required" | "named"
    parameters: dict[str, dict[str, Any]]  # tool name -> its parameters schema
    named: str | None = None
    parser: Callable[[str], Parsed] | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint that makes "required" and a named function always parse."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.parameters[str(self.named)])
        if self.mode != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
            }
            for name, schema in self.parameters.items()
        ]
        one = items[0] if len(items) == 1 else {"anyOf": items}
        return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": one})

    def read(
        self, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[dict], str | None]:
        """(content, tool_calls, finish_reason) of a finished choice's text."""
        calls: list[ToolCall] = []
        content: str | None = text
        if self.mode == "named" and finish_reason == "stop":
            calls, content = [ToolCall(str(self.named), _compact(text))], None
        elif self.mode == "required" and finish_reason == "stop":
            calls = [ToolCall(c["name"], _compact(c["parameters"])) for c in json.loads(text)]
            content = None
        elif self.mode == "auto" and self.parser is not None:
            content, calls = self.parser(text)
        if not calls:
            return text, [], finish_reason
        if self.mode in ("auto", "required"):
            finish_reason = "tool_calls"
        return content, [tool_call_dict(c) for c in calls], finish_reason


def _compact(value: Any) -> str:
    if isinstance(value, str):
        value = json.loads(value)
    return json.dumps(value, ensure_ascii=False)


def tool_call_dict(call: ToolCall) -> dict[str, Any]:
    return {
        "id": random_id("call"),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _parameters(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}.',
                param="tools",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ or -; got {name!r}.",
                param="tools",
            )
        if name in out:
            raise APIError(f"tools holds two functions named {name!r}.", param="tools")
        schema = fn.get("parameters")
        if schema is not None and not isinstance(schema, dict):
            raise APIError(f"tools[{i}].function.parameters must be an object.", param="tools")
        out[name] = schema or _ANY_OBJECT
    return out


def tool_setup(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parser_name: str | None
) -> ToolSetup | None:
    """The request's ToolSetup (None without tools).

    Raises:
        APIError: malformed tools, an unknown tool_choice or function, or "auto" on a server
            without --tool-call-parser.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError("tool_choice needs tools.", param="tool_choice")
        return None
    parameters = _parameters(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in parameters:
            raise APIError(
                f"tool_choice names no function of tools: {json.dumps(choice)[:100]}.",
                param="tool_choice",
            )
        return ToolSetup("named", parameters, named=name)
    if choice in ("none", "required"):
        return ToolSetup(choice, parameters)
    if choice != "auto":
        raise APIError(
            f'tool_choice must be "none", "auto", "required" or a function, got {choice!r}.',
            param="tool_choice",
        )
    if parser_name is None:
        raise APIError(
            'tool_choice "auto" needs a server started with --tool-call-parser (one of '
            f'{", ".join(TOOL_CALL_PARSERS)}); or send "required" or a named function.',
            param="tool_choice",
        )
    return ToolSetup("auto", parameters, parser=TOOL_CALL_PARSERS[parser_name])
