"""Tool calling on /v1/chat/completions: `tools`, `tool_choice` and `parallel_tool_calls`,
OpenAI's semantics.

    tool_choice "none"       the tools go to the chat template only; the answer is text
    tool_choice "auto"       (the default with tools) text or calls in the tool-call format
                             (server/tool_parsers.py): --tool-call-parser's, else the one the
                             chat template teaches; a template that knows none gets the
                             generic format (server/tool_fallback.py), enforced by the grammar
    tool_choice "required"   constrained to a JSON array of {"name", "parameters"} whose items
                             match one tool's schema each (the generic format: its envelope):
                             it always parses
    {"type": "function", "function": {"name": F}}   constrained to F's parameters schema

`parallel_tool_calls: false` allows at most one call: "required" and the generic, llama3_json
and mistral formats by the grammar (one item; text or one call), hermes by ending the answer
at the first `</tool_call>`, harmony by its `<|call|>`, a stop token.

Calls come back as `message.tool_calls` (ids `call-...`); finish_reason is "tool_calls" when
"auto" or "required" produced calls, "stop" for a named function (as vLLM and OpenAI do).
Streamed, text is sent as it comes until a call begins; each call then streams as OpenAI's
tool-call deltas (its id and name first, then its arguments as they are written).

Whole or streamed, a finished answer is read once, by `ToolSetup.answer`, so both give the same
calls. An answer cut off (finish_reason "length" or "abort", which it keeps) gives its complete
calls and an unfinished last one as far as it is written: the part a stream has already sent,
which it cannot take back, as OpenAI's own cut-off calls come.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from conveyor.server.errors import APIError
from conveyor.server.responses import random_id
from conveyor.server.tool_fallback import envelope_schema, tools_prompt
from conveyor.server.tool_parsers import (
    TOOL_CALL_PARSERS,
    PartialCall,
    Snapshot,
    ToolCall,
    parse_required,
    snapshot_required,
)
from conveyor.structured_params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ANY_OBJECT = {"type": "object", "properties": {}}
_BLANKS = " \t\r\n"
# An answer the engine ended early (max_tokens or the context; a deadline): its last call may
# be unfinished.
_CUT_OFF = ("length", "abort")


@dataclass(slots=True)
class ToolSetup:
    """The tools of one request and how the answer is read.

    format: the tool-call format (a TOOL_CALL_PARSERS name) the template and the answer use.
    """

    mode: str  # "none" | "auto" | "required" | "named"
    parameters: dict[str, dict[str, Any]]  # tool name -> its parameters schema
    named: str | None = None
    format: str = "generic"
    parallel: bool = True
    tools: list[dict[str, Any]] = field(default_factory=list)

    @property
    def generic(self) -> bool:
        return self.format == "generic"

    @property
    def markup(self) -> bool:
        """The format reads the whole answer, channels and all (harmony): it gets the text as
        generated, not what a reasoning parser left, and its content is never that text."""
        return TOOL_CALL_PARSERS[self.format].markup and self.mode in ("auto", "none")

    def system_prompt(self) -> str | None:
        """The tools' description for a template that cannot render them (None: no need)."""
        if not self.generic or self.mode == "none":
            return None
        return tools_prompt(self.tools, self.mode, self.parallel, self.named)

    def stop(self) -> list[str]:
        """Stop strings that end the answer after its one call (hermes, parallel false)."""
        if self.mode == "auto" and self.format == "hermes" and not self.parallel:
            return ["</tool_call>"]
        return []

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint: "required" and a named function always parse; "auto" in
        the generic format, or with parallel_tool_calls false, is text or a call. Building a
        text-or-call grammar loads xgrammar: call it off the event loop."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.parameters[str(self.named)])
        if self.mode == "none":
            return None
        if self.generic:
            envelope = envelope_schema(self.parameters, self.parallel)
            if self.mode == "required":
                return StructuredOutputsParams(json=envelope)
            return _text_or_call(envelope, "{")
        if self.mode == "required":
            return StructuredOutputsParams(json=self._array("parameters"))
        if self.parallel or self.format in ("hermes", "harmony"):
            return None
        if self.format == "llama3_json":
            return _text_or_call(self._one("parameters"), "{<")
        return _text_or_call(self._one("arguments"), "[", "[", "]")  # mistral

    def _one(self, key: str) -> dict[str, Any]:
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, key: schema},
                "required": ["name", key],
            }
            for name, schema in self.parameters.items()
        ]
        return items[0] if len(items) == 1 else {"anyOf": items}

    def _array(self, key: str) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": self._one(key)}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def snapshot(self, text: str) -> Snapshot:
        """What an unfinished answer has surely said: content, and calls as far as written."""
        if self.mode == "required" and not self.generic:
            return snapshot_required(text)
        return TOOL_CALL_PARSERS[self.format].snapshot(text)

    def snapshots(self) -> Any:
        """An incremental `snapshot` (its `feed(more)` reads all the text so far), or None."""
        make = TOOL_CALL_PARSERS[self.format].snapshots
        return make() if make is not None and self.mode != "required" else None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished answer's content and calls."""
        if self.mode == "required" and not self.generic:
            calls = parse_required(text)
            return (text, []) if calls is None else (None, calls)
        return TOOL_CALL_PARSERS[self.format].parse(text)

    def answer(
        self, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish_reason) of a finished answer: the one reading of a whole
        answer (`read`) and of a stream's end (`ToolCallStream.finish`). A cut-off answer
        keeps its finish_reason and its calls as far as written (the module docstring)."""
        if self.mode == "named":  # its arguments are the whole text, streamed as they come
            return None, [ToolCall(str(self.named), text)], finish_reason
        if self.mode == "none":
            return (self.parse(text)[0] if self.markup else text), [], finish_reason
        content, calls = self.parse(text)
        cut_off = finish_reason in _CUT_OFF
        if not calls and cut_off and not self.markup:  # harmony's parse has the cut-off call
            content, partial = self.snapshot(text)
            calls = [ToolCall(c.name, c.arguments) for c in _named(partial)]
            content = content.strip() or None
        if not calls:
            return (content if self.markup else text), [], finish_reason
        return content, calls, finish_reason if cut_off else "tool_calls"

    def read(
        self, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[dict], str | None]:
        """(content, tool_calls, finish_reason) of a finished choice's text."""
        content, calls, finish_reason = self.answer(text, finish_reason)
        return content, [tool_call_dict(c) for c in calls], finish_reason


def _text_or_call(
    schema: dict[str, Any], opener: str, prefix: str = "", suffix: str = ""
) -> StructuredOutputsParams:
    from conveyor.structured.grammar import text_or_json_ebnf

    ebnf = text_or_json_ebnf(schema, opener + _BLANKS, prefix, suffix)
    return StructuredOutputsParams(grammar=ebnf)


class ToolCallStream:
    """One streamed choice's tool calls: its text turned into content deltas and OpenAI's
    tool-call deltas as it grows (see the module docstring)."""

    def __init__(self, setup: ToolSetup) -> None:
        self._setup = setup
        self._text = ""
        self._content = 0  # characters of content sent
        self._calls: list[tuple[str, str]] = []  # (name, arguments sent) per call begun
        self._snapshots = setup.snapshots()

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) after `text` more of the answer."""
        self._text += text
        if self._snapshots is not None:
            content, calls = self._snapshots.feed(text)
        else:
            content, calls = self._setup.snapshot(self._text)
        return self._content_delta(content), self._call_deltas(calls)

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """The last deltas once the answer is complete, and its finish_reason, read by
        ToolSetup.answer as the whole answer is. A call that turns out malformed in an answer
        that was not cut off, after its first deltas were sent, stays as sent."""
        content, calls, finish_reason = self._setup.answer(self._text, finish_reason)
        markup = self._setup.markup  # its content may go on after a call, or be held back
        if not calls and not self._calls:
            rest = (content or "") if markup else self._text
            return self._content_delta(rest), [], finish_reason
        partial = [PartialCall(c.name, c.arguments) for c in calls]
        rest = self._content_delta(content or "") if markup else ""
        return rest, self._call_deltas(partial), finish_reason

    def _content_delta(self, content: str) -> str:
        if len(content) <= self._content:
            return ""
        delta, self._content = content[self._content :], len(content)
        return delta

    def _call_deltas(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(_named(calls)):
            if i == len(self._calls):
                self._calls.append((call.name, call.arguments))
                deltas.append({"index": i, **tool_call_dict(ToolCall(call.name, call.arguments))})
                continue
            name, sent = self._calls[i]
            if name != call.name or not call.arguments.startswith(sent):
                continue  # what was sent cannot be taken back
            if len(call.arguments) > len(sent):
                delta = call.arguments[len(sent) :]
                self._calls[i] = (name, call.arguments)
                deltas.append({"index": i, "function": {"arguments": delta}})
        return deltas


def _named(calls: list[PartialCall]) -> list[PartialCall]:
    """The calls up to the first whose name is not yet complete (what a stream can send)."""
    out = []
    for call in calls:
        if call.name is None:
            break
        out.append(call)
    return out


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
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    tool_format: str = "generic",
    parallel_tool_calls: bool | None = None,
) -> ToolSetup | None:
    """The request's ToolSetup (None without tools).

    Args:
        tool_format: the tool-call format (--tool-call-parser's, or the template's).
    Raises:
        APIError: malformed tools, an unknown tool_choice or function.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError("tool_choice needs tools.", param="tool_choice")
        return None
    parameters = _parameters(tools)
    kw = dict(format=tool_format, parallel=parallel_tool_calls is not False, tools=tools)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in parameters:
            raise APIError(
                f"tool_choice names no function of tools: {json.dumps(choice)[:100]}.",
                param="tool_choice",
            )
        return ToolSetup("named", parameters, named=name, **kw)
    if choice in ("none", "required"):
        return ToolSetup(choice, parameters, **kw)
    if choice != "auto":
        raise APIError(
            f'tool_choice must be "none", "auto", "required" or a function, got {choice!r}.',
            param="tool_choice",
        )
    return ToolSetup("auto", parameters, **kw)
