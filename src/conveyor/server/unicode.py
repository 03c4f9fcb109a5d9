"""Lone UTF-16 surrogates in request JSON: found before any of it reaches a tokenizer.

JSON may spell any code unit (`"\\udfff"`), and Python's json decodes an unpaired one into a
`str` that holds a surrogate: not Unicode text. Tokenizers raise TypeError on it and UTF-8
cannot encode it, so an answer that echoes it would fail too. protocol.py refuses any field
holding one with a 400.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTAINERS = frozenset({str, list, dict})  # what decoded JSON holds strings in


def find_lone_surrogate(value: Any, path: str = "") -> tuple[str, str] | None:
    """Where the first string (or dict key) holding a surrogate is, inside `value`.

    Args:
        value: a decoded JSON value: str, list, dict, or a scalar.
        path: the location of `value`, for the answer.
    Returns:
        (" at <path>" or "", "U+XXXX") for the first one found, or None if there is none.
    """
    if isinstance(value, str):
        if value.isascii():  # the common case, at C speed
            return None
        found = _SURROGATE.search(value)
        if found is None:
            return None
        return (f" at {path}" if path else ""), f"U+{ord(found.group()):04X}"
    if isinstance(value, list):
        if not _CONTAINERS.intersection(map(type, value)):
            return None  # e.g. token ids: no Python work per number
        for i, item in enumerate(value):
            if type(item) not in _CONTAINERS:
                continue
            where = find_lone_surrogate(item, f"{path}[{i}]")
            if where is not None:
                return where
    elif isinstance(value, dict):
        for key, item in value.items():
            where = find_lone_surrogate(key, path) or find_lone_surrogate(item, f"{path}.{key}")
            if where is not None:
                return where
    return None
