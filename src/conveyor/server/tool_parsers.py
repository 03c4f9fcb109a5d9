"""Tool-call formats: a model's own way of writing tool calls, read from its text
(`tool_choice: "auto"`). `--tool-call-parser NAME` picks one; without it the chat template
decides (`detect_tool_format`). A format is a parser, a streaming snapshot and one registry line.

    hermes       Qwen2.5, Qwen3, Hermes: text <tool_call>{"name": .., "arguments": {..}}</tool_call>
    llama3_json  Llama 3.x:   [<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]
    mistral      Mistral:     text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                              (or [TOOL_CALLS]name[ARGS]{...}, the newer templates' form)
    generic      any template (server/tool_fallback.py): plain text, or only
                              {"tool_calls": [{"name": ..., "arguments": {...}}]}
    harmony      gpt-oss:     messages to functions.NAME (server/harmony.py); it reads the
                              whole answer, channels and all, so its content is never the
                              text as written

A call's `arguments` are the JSON text the model wrote for them (a JSON string holding an
object is decoded first), so streamed argument deltas add up to exactly the same text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.server.harmony import CHANNEL, HarmonyReader, read_harmony


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it


@dataclass(slots=True)
class PartialCall:
    """A call as far as a stream has written it: its name once that is complete, and the
    part of its arguments' text that can no longer change."""

    name: str | None
    arguments: str


# A parser's result: the text left over as content (None if none) and the calls; no calls
# means the model answered in plain text.
Parsed = tuple[str | None, list[ToolCall]]
# A stream's snapshot of unfinished text: the content that is sure to be content, the calls.
Snapshot = tuple[str, list[PartialCall]]

_DECODER = json.JSONDecoder()
_WS = " \t\r\n"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_TAG = "[TOOL_CALLS]"
_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_-]{1,64})\[ARGS\]")


# ---------------------------------------------------------------- a partial JSON object
def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


@dataclass(slots=True)
class _Scan:
    """What `_scan_object` read: complete members (key -> (value, start, end) in the text),
    the member whose value is still open (key, start), and where the object ended (None:
    not yet, or not an object)."""

    members: dict[str, tuple[Any, int, int]]
    open_key: str | None = None
    open_start: int = 0
    end: int | None = None


def _scan_object(s: str, pos: int) -> _Scan | None:
    """The members of the JSON object at `pos`, as far as `s` holds it (None: `s[pos]` does
    not start an object, or it is malformed)."""
    i = _skip_ws(s, pos)
    if i >= len(s) or s[i] != "{":
        return None
    scan, i = _Scan({}), i + 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return scan
        if s[i] == "}":
            scan.end = i + 1
            return scan
        if s[i] == "," and scan.members:
            i += 1
            continue
        try:
            key, i = _DECODER.raw_decode(s, i)
        except json.JSONDecodeError:
            return scan if s[i] == '"' and '"' not in s[i + 1 :] else None
        i = _skip_ws(s, i)
        if i >= len(s):
            return scan
        if s[i] != ":" or not isinstance(key, str):
            return None
        start = _skip_ws(s, i + 1)
        try:
            value, i = _DECODER.raw_decode(s, start)
        except json.JSONDecodeError:
            scan.open_key, scan.open_start = key, start
            return scan
        scan.members[key] = (value, start, i)


def _arguments_text(value: Any, raw: str) -> str | None:
    """The arguments' JSON text: as written for an object, decoded first from a string."""
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None
    return raw if isinstance(value, dict) else None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _call_at(s: str, pos: int, keys: tuple[str, ...]) -> tuple[ToolCall, int] | None:
    """The complete call object at `pos` and where it ends (None: no valid call there)."""
    scan = _scan_object(s, pos)
    if scan is None or scan.end is None or not _is_json(s[_skip_ws(s, pos) : scan.end]):
        return None
    name = scan.members.get("name")
    if name is None or not isinstance(name[0], str):
        return None
    args = next((scan.members[k] for k in keys if k in scan.members), None)
    text = "{}" if args is None else _arguments_text(args[0], s[args[1] : args[2]])
    if text is None:
        return None
    return ToolCall(name[0], text), scan.end


def _partial_call(
    s: str, pos: int, keys: tuple[str, ...], tail: str = "", scan: _Scan | None = None
) -> PartialCall | None:
    """The call at `pos` as far as it is written: its name once complete and the stable part of
    its arguments (those whose name came before them; a string's arguments wait for the end).
    `scan`: the object at `pos`, when the caller has scanned it already."""
    scan = scan or _scan_object(s, pos)
    if scan is None:
        return None
    name = scan.members.get("name")
    if name is None or not isinstance(name[0], str):
        return None
    args = next((scan.members[k] for k in keys if k in scan.members), None)
    if args is not None:
        text = _arguments_text(args[0], s[args[1] : args[2]])
        return PartialCall(name[0], text if text is not None and args[1] > name[1] else "")
    if scan.open_key in keys and scan.open_start > name[1] and s.startswith("{", scan.open_start):
        # Unfinished arguments: all but what may still be the end of the call.
        text = _without_partial_tag(s[scan.open_start :], tail)
        return PartialCall(name[0], text.rstrip(_WS + "}];,"))
    return PartialCall(name[0], "")


def _without_partial_tag(text: str, tag: str) -> str:
    """`text` without a last part that may be the start of `tag`."""
    for n in range(min(len(tag), len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return text[:-n]
    return text


def _calls_sequence(
    s: str, pos: int, sep: str, keys: tuple[str, ...], close: str = ""
) -> tuple[list[ToolCall], int] | None:
    """Call objects from `pos`, `sep` between them, up to `close` (or the end of `s`)."""
    calls: list[ToolCall] = []
    while True:
        found = _call_at(s, pos, keys)
        if found is None:
            return None
        calls.append(found[0])
        pos = _skip_ws(s, found[1])
        if pos < len(s) and s[pos] == sep:
            pos += 1
            continue
        if close and s.startswith(close, pos):
            return calls, pos + len(close)
        return (calls, pos) if not close else None


def _partial_sequence(s: str, pos: int, sep: str, keys: tuple[str, ...]) -> list[PartialCall]:
    out: list[PartialCall] = []
    while True:
        scan = _scan_object(s, pos)
        call = _partial_call(s, pos, keys, scan=scan) if scan is not None else None
        if call is None:
            return out
        out.append(call)
        if scan is None or scan.end is None:
            return out
        pos = _skip_ws(s, scan.end)
        if pos >= len(s) or s[pos] != sep:
            return out
        pos += 1


# ---------------------------------------------------------------- hermes
def parse_hermes(text: str) -> Parsed:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text, start):
        found = _call_at(body, 0, ("arguments", "parameters"))
        if found is None or _skip_ws(body, found[1]) != len(body):
            return text, []  # a malformed call: the whole answer stays text
        calls.append(found[0])
    content = text[:start].strip()
    return content or None, calls


def snapshot_hermes(text: str) -> Snapshot:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return _without_partial_tag(text, _HERMES_OPEN), []
    calls = []
    while start >= 0:
        body_start = start + len(_HERMES_OPEN)
        end = text.find(_HERMES_CLOSE, body_start)
        body = text[body_start : end if end >= 0 else len(text)]
        call = _partial_call(body, 0, ("arguments", "parameters"), _HERMES_CLOSE)
        if call is None or end < 0:
            calls += [call] if call is not None else []
            break
        calls.append(call)
        start = text.find(_HERMES_OPEN, end)
    return text[: text.find(_HERMES_OPEN)], calls


# ---------------------------------------------------------------- llama3_json
_LLAMA_KEYS = ("parameters", "arguments")


def _llama3_body(text: str) -> int:
    """Where the calls of a Llama 3 answer start (after blanks and <|python_tag|>)."""
    i = _skip_ws(text, 0)
    if text.startswith(_PYTHON_TAG, i):
        i = _skip_ws(text, i + len(_PYTHON_TAG))
    return i


def parse_llama3_json(text: str) -> Parsed:
    pos = _llama3_body(text)
    if not text.startswith("{", pos):
        return text, []
    found = _calls_sequence(text, pos, ";", _LLAMA_KEYS)
    if found is None or _skip_ws(text, found[1]) != len(text):
        return text, []
    return None, found[0]


def snapshot_llama3_json(text: str) -> Snapshot:
    pos = _llama3_body(text)
    rest = text[pos:]
    if not rest or _PYTHON_TAG.startswith(rest):
        return "", []  # a call may still begin
    if not rest.startswith("{"):
        return text, []
    return "", _partial_sequence(text, pos, ";", _LLAMA_KEYS)


# ---------------------------------------------------------------- mistral
_MISTRAL_KEYS = ("arguments", "parameters")


def _mistral_body(text: str) -> tuple[str, int] | None:
    """The content before the calls and where they start: after [TOOL_CALLS], or at a
    leading JSON array of calls (the tag is a special token some outputs leave out)."""
    start = text.find(_MISTRAL_TAG)
    if start >= 0:
        return text[:start], _skip_ws(text, start + len(_MISTRAL_TAG))
    i = _skip_ws(text, 0)
    if text.startswith("[", i) and text.startswith("{", _skip_ws(text, i + 1)):
        return "", i
    return None


def parse_mistral(text: str) -> Parsed:
    found = _mistral_body(text)
    if found is None:
        return text, []
    content, pos = found
    calls: list[ToolCall] = []
    if text.startswith("[", pos):
        seq = _calls_sequence(text, pos + 1, ",", _MISTRAL_KEYS, close="]")
        if seq is None or _skip_ws(text, seq[1]) != len(text):
            return text, []
        calls = seq[0]
    else:  # name[ARGS]{...}, each after its own [TOOL_CALLS]
        while pos < len(text):
            named = _MISTRAL_NAMED.match(text, pos)
            if named is None:
                return text, []
            try:
                args, end = _DECODER.raw_decode(text, _skip_ws(text, named.end()))
            except json.JSONDecodeError:
                return text, []
            if not isinstance(args, dict):
                return text, []
            calls.append(ToolCall(named.group(1), text[_skip_ws(text, named.end()) : end]))
            pos = _skip_ws(text, end)
            if text.startswith(_MISTRAL_TAG, pos):
                pos = _skip_ws(text, pos + len(_MISTRAL_TAG))
        if not calls:
            return text, []
    return content.strip() or None, calls


def snapshot_mistral(text: str) -> Snapshot:
    found = _mistral_body(text)
    if found is None:
        stripped = text.lstrip(_WS)
        if stripped in ("", "["):
            return "", []  # a leading array of calls may still begin
        return _without_partial_tag(text, _MISTRAL_TAG), []
    content, pos = found
    if not text.startswith("[", pos):
        return content, []  # the name[ARGS] form: its calls come when it is finished
    return content, _partial_sequence(text, pos + 1, ",", _MISTRAL_KEYS)


# ---------------------------------------------------------------- required
def parse_required(text: str) -> list[ToolCall] | None:
    """The calls of tool_choice "required"'s JSON array of {"name", "parameters"} (None: the
    text is not a whole array of calls, e.g. cut off by max_tokens)."""
    pos = _skip_ws(text, 0)
    if not text.startswith("[", pos):
        return None
    seq = _calls_sequence(text, pos + 1, ",", ("parameters",), close="]")
    if seq is None or _skip_ws(text, seq[1]) != len(text):
        return None
    return seq[0]


def snapshot_required(text: str) -> Snapshot:
    pos = _skip_ws(text, 0)
    if not text.startswith("[", pos):
        return "", []
    return "", _partial_sequence(text, pos + 1, ",", ("parameters",))


# ---------------------------------------------------------------- generic
def parse_generic(text: str) -> Parsed:
    if not text.startswith("{"):
        return text, []
    scan = _scan_object(text, 0)
    calls_at = scan.members.get("tool_calls") if scan is not None else None
    if scan is None or scan.end is None or calls_at is None or text[scan.end :].strip():
        return text, []
    pos = calls_at[1]
    if not text.startswith("[", pos):
        return text, []
    seq = _calls_sequence(text, pos + 1, ",", ("arguments",), close="]")
    if seq is None or seq[1] != calls_at[2]:
        return text, []
    return None, seq[0]


def snapshot_generic(text: str) -> Snapshot:
    if not text.startswith("{"):
        return text, []
    scan = _scan_object(text, 0)
    if scan is None:
        return "", []
    start = scan.open_start if scan.open_key == "tool_calls" else None
    if "tool_calls" in scan.members:  # the array is whole, the envelope not yet closed
        start = scan.members["tool_calls"][1]
    if start is None or not text.startswith("[", start):
        return "", []
    return "", _partial_sequence(text, start + 1, ",", ("arguments",))


# ---------------------------------------------------------------- harmony
def parse_harmony(text: str) -> Parsed:
    answer = read_harmony(text)
    return answer.content or None, [ToolCall(c.name, c.arguments) for c in answer.calls]


def snapshot_harmony(text: str) -> Snapshot:
    return HarmonySnapshots().feed(text)


class HarmonySnapshots:
    """`snapshot_harmony` of a growing answer, read as it grows rather than from its start."""

    def __init__(self) -> None:
        self._reader = HarmonyReader()
        self._content = ""

    def feed(self, text: str) -> Snapshot:
        self._content += self._reader.feed(text)[1]
        return self._content, [PartialCall(c.name, c.arguments) for c in self._reader.calls]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A format's reading of a whole answer and of one still growing.

    markup: its text is markup, never content as written (harmony): the content is always
        the parse's, with or without calls.
    snapshots: makes an object whose `feed(more_text)` is `snapshot` of all the text so far,
        read incrementally (None: a stream calls `snapshot` on the whole text each time).
    """

    parse: Callable[[str], Parsed]
    snapshot: Callable[[str], Snapshot]
    markup: bool = False
    snapshots: Callable[[], HarmonySnapshots] | None = None


TOOL_CALL_PARSERS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(parse_hermes, snapshot_hermes),
    "llama3_json": ToolFormat(parse_llama3_json, snapshot_llama3_json),
    "mistral": ToolFormat(parse_mistral, snapshot_mistral),
    "generic": ToolFormat(parse_generic, snapshot_generic),
    "harmony": ToolFormat(parse_harmony, snapshot_harmony, True, HarmonySnapshots),
}


def detect_tool_format(template: str | None) -> str:
    """The tool-call format a chat template teaches its model, from the template's text:
    "generic" when it names none of the known formats (it cannot render tools, as
    SmolLM2's, or renders them some other way)."""
    if not template:
        return "generic"
    if CHANNEL in template:  # gpt-oss (its template also names "parameters" and tools)
        return "harmony"
    if _HERMES_OPEN in template:  # Qwen2.5, Qwen3, Hermes 2/3
        return "hermes"
    if _MISTRAL_TAG in template:
        return "mistral"
    if _PYTHON_TAG in template or ('"parameters"' in template and "tools" in template):
        return "llama3_json"  # Llama 3.1 / 3.2 / 3.3
    return "generic"
