"""Tool-call parsers: a model's own tool-call format, read from its text after generation
(`tool_choice: "auto"`). `--tool-call-parser NAME` picks one; a parser is one function and one
registry line.

    hermes       Hermes / Qwen2.5:  text <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json  Llama 3.x JSON:    [<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it


# A parser's result: the text left over as content (None if none) and the calls; no calls
# means the model answered in plain text.
Parsed = tuple[str | None, list[ToolCall]]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _call(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> Parsed:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text, start):
        try:
            call = _call(json.loads(body), ("arguments", "parameters"))
        except json.JSONDecodeError:
            call = None
        if call is None:  # a malformed call: the whole answer stays text
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> Parsed:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        rest = body[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return text, []
        pos = len(body) - len(rest)
    return None, calls


TOOL_CALL_PARSERS: dict[str, Callable[[str], Parsed]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
}
