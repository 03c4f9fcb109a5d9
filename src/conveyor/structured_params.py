"""What a request's output must match: a JSON schema, any JSON object, a regex, a choice of
strings, or an EBNF grammar (vLLM's StructuredOutputsParams).

Plain data, no xgrammar: it travels inside SamplingParams to the engine process (pickled on
the command pipe) and is compiled there (conveyor.structured.grammar). `key` is what the engine's
grammar cache is keyed by, so equal constraints compile once.

It pickles as its canonical text, not as the nested dicts of a schema: pickle recurses once per
level, and a schema deep enough failed the pipe's writer thread for every later request. A
schema nesting deeper than MAX_SCHEMA_DEPTH is refused when the params are made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from conveyor.json_depth import MAX_JSON_DEPTH, deep_path, deep_text_path, format_path

# The kinds of constraint, exactly one of which a StructuredOutputsParams sets.
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# A schema or grammar larger than this is refused before anything compiles it.
MAX_SPEC_CHARS = 256 * 1024
# The deepest schema, in objects and arrays: a request body's limit plus the levels the server
# wraps around a tool's parameters (server/tools.py).
MAX_SCHEMA_DEPTH = MAX_JSON_DEPTH + 8


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one of:

    json: a JSON schema (a dict, or its JSON text); the output is JSON valid against it.
    json_object: True: the output is any JSON object.
    regex: the output matches this regular expression (whole output).
    choice: the output is exactly one of these strings.
    grammar: the output matches this EBNF grammar (xgrammar's / GBNF dialect, `root` rule).

    disable_any_whitespace (the JSON kinds): True (the default) allows no free whitespace
    between JSON tokens, so a model cannot fill its whole budget with spaces; False allows
    any whitespace there (xgrammar's default, vLLM's `disable_any_whitespace=False`).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True
    # The canonical text of the constraint (compact schema JSON, the regex, ...).
    spec: str = field(init=False, default="")
    # The server's estimate of its compile cost (structured/grammar_bounds.py), set once its
    # checks passed: the engine compiles it in the lane that cost calls for. None: unknown.
    compile_cost: float | None = field(init=False, default=None, compare=False)

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice "
                f"or grammar, got {set_kinds or 'none'}."
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean.")
        self.spec = _canonical(set_kinds[0], getattr(self, set_kinds[0]))
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(
                f"structured_outputs.{set_kinds[0]} must be at most {MAX_SPEC_CHARS} characters, "
                f"got {len(self.spec)}."
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """Equal keys compile to the same grammar (the engine's cache key)."""
        kind = self.kind
        compact = self.disable_any_whitespace if kind in ("json", "json_object") else True
        return (kind, self.spec, compact)

    def __reduce__(self) -> tuple[Any, ...]:
        # As text (see the module's docstring): unpickling parses it back without recursing
        # deeper than MAX_SCHEMA_DEPTH, the limit it was checked against when it was made.
        return (_from_spec, (self.kind, self.spec, self.disable_any_whitespace,
                             self.compile_cost))  # fmt: skip

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> StructuredOutputsParams:
        """From the request body's `structured_outputs` object (unknown keys are a ValueError,
        so a constraint we do not implement is never silently dropped)."""
        known = {*KINDS, "disable_any_whitespace"}
        unknown = sorted(k for k, v in value.items() if k not in known and v is not None)
        if unknown:
            raise ValueError(
                f"structured_outputs.{unknown[0]} is not supported; use one of {', '.join(KINDS)}."
            )
        return cls(**{k: v for k, v in value.items() if v is not None})


def _from_spec(
    kind: str, spec: str, disable_any_whitespace: bool, compile_cost: float | None = None
) -> StructuredOutputsParams:
    """The params `__reduce__` sent, without checking them again."""
    so = object.__new__(StructuredOutputsParams)
    for name in KINDS:
        setattr(so, name, None)
    value: Any = spec
    if kind in ("json", "choice"):
        value = json.loads(spec)
    elif kind == "json_object":
        value = True
    setattr(so, kind, value)
    so.disable_any_whitespace, so.spec = disable_any_whitespace, spec
    so.compile_cost = compile_cost
    return so


def _check_depth(value: Any) -> None:
    if isinstance(value, str):  # before json.loads, which recurses
        path = deep_text_path(value, MAX_SCHEMA_DEPTH)
    else:
        path = deep_path(value, MAX_SCHEMA_DEPTH)
    if path is not None:
        where = f" (at {format_path(path)})" if path else ""
        raise ValueError(
            f"structured_outputs.json must nest at most {MAX_SCHEMA_DEPTH} objects and arrays "
            f"deep, got a deeper schema{where}."
        )


def _canonical(kind: str, value: Any) -> str:
    if kind == "json":
        _check_depth(value)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}.") from None
        if not isinstance(value, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object.")
        return json.dumps(value, separators=(",", ":"))
    if kind == "json_object":
        if value is not True:
            raise ValueError("structured_outputs.json_object must be true.")
        return ""
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        if not all(isinstance(c, str) and c for c in value):
            raise ValueError("structured_outputs.choice must hold non-empty strings only.")
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string.")
    return value
