"""The checks an output constraint passes before anything compiles it (structured/limits.py),
and the server's check of whether a small constraint allows any output at all."""

from __future__ import annotations

import json
import time

import pytest
from tests.structured.structured_schemas import SCHEMAS

from conveyor.structured.grammar import GrammarUnsatisfiableError, check_structured_outputs
from conveyor.structured.limits import (
    MAX_ENUM_VALUES,
    MAX_OPTIONAL_PROPERTIES,
    MAX_PROPERTIES,
    MAX_REPEAT,
    ConstraintLimitError,
    check_constraint,
    check_schema,
)
from conveyor.structured_params import StructuredOutputsParams


def _check(**kind: object) -> None:
    so = StructuredOutputsParams(**kind)  # type: ignore[arg-type]
    check_constraint(so.kind, so.spec, f"structured_outputs.{so.kind}", len(so.choice or ()))


def _props(n: int, required: bool = False, prefix: str = "p") -> dict:
    props = {f"{prefix}{i}": {"type": "string"} for i in range(n)}
    schema: dict = {"type": "object", "properties": props}
    if required:
        schema["required"] = list(props)
    return schema


def test_every_test_schema_passes_the_limits() -> None:
    for model in SCHEMAS:
        _check(json=model.model_json_schema())
    _check(json={"anyOf": [{"type": "null"}, {"$ref": "#"}]})  # recursion with a way out
    _check(json={"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                 "$ref": "#/$defs/n"})  # fmt: skip
    _check(regex=r"[0-9]{2}w")
    _check(grammar='root ::= "{99999}" | [a-z]{1,10}')  # a literal "{99999}" repeats nothing


def test_a_schema_with_5000_properties_is_refused_in_milliseconds() -> None:
    # Compact: 5,000 properties in ~115 KB (the server's size limit would refuse it first).
    schema = _props(5000, required=True)
    spec = json.dumps(schema, separators=(",", ":"))
    start = time.thread_time()
    with pytest.raises(ConstraintLimitError, match=f"at most {MAX_PROPERTIES} properties"):
        check_schema(schema, "structured_outputs.json")
    with pytest.raises(ConstraintLimitError, match=r"structured_outputs\.json must be at most"):
        check_constraint("json", spec, "structured_outputs.json")
    # This thread's CPU time: other processes on a loaded machine stretch the wall clock, not
    # this. 2 s is far above the milliseconds the checks take and below the 56-138 s compile.
    assert time.thread_time() - start < 2.0


def test_optional_properties_are_limited_per_object() -> None:
    _check(json=_props(MAX_OPTIONAL_PROPERTIES))
    _check(json=_props(1000, required=True))
    with pytest.raises(ConstraintLimitError, match=f"at most {MAX_OPTIONAL_PROPERTIES} optional"):
        _check(json=_props(MAX_OPTIONAL_PROPERTIES + 1))


def test_100k_choices_and_enum_values_are_refused() -> None:
    with pytest.raises(ValueError, match=r"structured_outputs\.choice must be at most"):
        _check(choice=[f"c{i}" for i in range(100_000)])  # ~1 MB: refused when it is made
    with pytest.raises(ConstraintLimitError, match=f"at most {MAX_ENUM_VALUES} strings"):
        _check(choice=[f"c{i}" for i in range(MAX_ENUM_VALUES + 1)])
    with pytest.raises(ConstraintLimitError, match=f"at most {MAX_ENUM_VALUES} enum values"):
        check_schema({"enum": [f"c{i}" for i in range(100_000)]}, "structured_outputs.json")
    _check(choice=[f"c{i}" for i in range(1000)])


@pytest.mark.parametrize(
    "kind",
    [{"regex": "[a-z]{1,5000}"}, {"regex": "(ab){5001}"}, {"grammar": "root ::= [a-z]{2000}"},
     {"json": {"type": "string", "pattern": "[a-z]{1,5000}"}}],
    ids=["regex-range", "regex-exact", "grammar", "pattern"],
)  # fmt: skip
def test_repetition_counts_are_limited(kind: dict) -> None:
    """`[a-z]{1,5000}` in a pattern took 2.5 s of the server's CPU to build, for a 400."""
    with pytest.raises(ConstraintLimitError, match=f"at most {MAX_REPEAT}"):
        _check(**kind)
    _check(regex=r"\{5000\}[{]5000}")  # escaped and in a class: literal braces


UNENFORCEABLE = [
    ({"$ref": "https://example.com/schema.json"}, "remote|nothing is fetched"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf with 2 schemas"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "string", "format": "email", "maxLength": 9}, "format together"),
]


@pytest.mark.parametrize(("schema", "match"), UNENFORCEABLE, ids=[m for _, m in UNENFORCEABLE])
def test_what_the_grammar_cannot_enforce_is_refused(schema: dict, match: str) -> None:
    with pytest.raises(ConstraintLimitError, match=match):
        _check(json=schema)


UNSATISFIABLE = [
    {"allOf": [{"$ref": "#"}]},
    {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
     "$ref": "#/$defs/a"},
    {"properties": {"x": False}, "required": ["x"]},
]  # fmt: skip


@pytest.mark.parametrize(
    "schema", UNSATISFIABLE, ids=["allOf-self", "required-self", "cycle", "required-false"]
)
def test_a_schema_that_only_refers_to_itself_is_refused(schema: dict) -> None:
    with pytest.raises(ConstraintLimitError, match="can never be satisfied"):
        _check(json=schema)


def test_a_long_reference_chain_is_checked_in_linear_time() -> None:
    n = 1900
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    start = time.thread_time()
    _check(json={"$defs": defs, "$ref": "#/$defs/d0"})
    assert time.thread_time() - start < 2.0  # CPU time of this thread: load does not stretch it


@pytest.mark.parametrize(
    ("kind", "param"), [({"regex": r"[^\s\S]"}, "regex"), ({"grammar": "root ::= root"}, "grammar"),
                        ({"json": {"type": "string", "pattern": r"[^\s\S]"}}, "json")],
)  # fmt: skip
def test_a_small_constraint_that_matches_nothing_is_refused_before_the_engine(kind, param) -> None:
    with pytest.raises(GrammarUnsatisfiableError, match=rf"structured_outputs\.{param} can never"):
        check_structured_outputs(StructuredOutputsParams(**kind))
    check_structured_outputs(StructuredOutputsParams(regex="[0-9]{2}w"))
    check_structured_outputs(StructuredOutputsParams(grammar='root ::= ""'))  # empty is output
