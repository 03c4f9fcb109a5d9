"""How deep JSON nests, measured without recursion.

Python's recursive walkers (pickle, json.loads and json.dumps, copy.deepcopy, a grammar
compiler's schema converter) fail on deeply nested values with a RecursionError, or worse,
and a request can nest as deep as its body allows. So whatever a request carries is checked
here first, with loops and an explicit stack, and refused when it nests deeper than
MAX_JSON_DEPTH objects and arrays:

    depth  0: 1, "a", null          1: [], {"a": 1}          2: [[1]], {"a": {"b": 1}}

A path names where the first container beyond the limit sits, from the root: a key per
object, an index per array, e.g. ("tools", 0, "function", "parameters", "properties", ...).

A plain module (no imports beyond the standard library): the server checks request bodies
with it before they are parsed, StructuredOutputsParams checks the schemas it is given.
"""

from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate
from typing import Any

MAX_JSON_DEPTH = 64

Path = tuple[str | int, ...]

# A JSON string, or one of the characters that shape the structure. The string pattern is
# the unrolled loop, linear on long strings.
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},]')
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPENS_CLOSES = bytes.maketrans(b"[]{}", b"\x01\xff\x01\xff")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))


def deep_path(value: Any, max_depth: int = MAX_JSON_DEPTH) -> Path | None:
    """Where a Python value (dicts, lists and tuples of anything) nests deeper than
    `max_depth` containers: the path to the first container beyond it, None if nowhere.
    Shared containers are walked once per reference, cycles count as deep."""
    if not isinstance(value, (dict, list, tuple)):
        return None
    # (container, its path); the path's length is the container's depth minus one.
    stack: list[tuple[Any, Path]] = [(value, ())]
    while stack:
        container, path = stack.pop()
        if len(path) >= max_depth:
            return path
        items = container.items() if isinstance(container, dict) else enumerate(container)
        children = [(v, (*path, k)) for k, v in items if isinstance(v, (dict, list, tuple))]
        stack.extend(reversed(children))  # depth first, in document order
    return None


def max_text_depth(text: bytes) -> int:
    """How deep the JSON text `text` nests (brackets inside strings do not count). Loops in
    C only: a 10 MiB body takes well under a second."""
    if text.count(b"[") + text.count(b"{") == 0:
        return 0
    brackets = _STRINGS.sub(b"", text).translate(None, _NOT_BRACKETS)
    steps = array("b", brackets.translate(_OPENS_CLOSES))
    return max(accumulate(steps), default=0)


def deep_text_path(text: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Path | None:
    """Where the JSON text `text` nests deeper than `max_depth` containers: the path to the
    first container beyond it, None if nowhere. Malformed text is measured as far as it goes
    (the parser that follows reports it)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= max_depth or max_text_depth(data) <= max_depth:
        return None
    # Too deep: walk the tokens for the path (each level's current key or index).
    stack: list[list[Any]] = []  # [bracket, key or index, expecting a key]
    for match in _TOKENS.finditer(data):
        token = match.group()
        first = token[:1]
        if first in (b"[", b"{"):
            if len(stack) >= max_depth:
                return tuple(level[1] for level in stack)
            stack.append([first, 0, True] if first == b"[" else [first, "", True])
        elif first in (b"]", b"}"):
            if stack:
                stack.pop()
        elif not stack:
            continue
        elif first == b",":
            level = stack[-1]
            if level[0] == b"[":
                level[1] += 1
            else:
                level[2] = True
        elif stack[-1][0] == b"{" and stack[-1][2]:  # a member's key
            stack[-1][1], stack[-1][2] = _key(token), False
    return ()  # only an unterminated string can hide the brackets from the walk


def _key(token: bytes) -> str:
    try:
        return json.loads(token)
    except ValueError:  # a malformed escape: the parser reports it later
        return token[1:-1].decode("utf-8", "replace")


def format_path(path: Path, limit: int = 6) -> str:
    """A path as `a.b[0].c`, its first `limit` steps only (then `...`)."""
    text = ""
    for step in path[:limit]:
        text += f"[{step}]" if isinstance(step, int) else (f".{step}" if text else str(step))
    return text + ("..." if len(path) > limit else "")
