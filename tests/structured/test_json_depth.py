"""JSON depth, measured without recursion (issue 27, item 1): Python values and raw text agree,
brackets inside strings do not count, and nothing deep makes the check itself recurse; a
structured-output schema too deep is refused when the params are made, and one that is not
crosses a pipe as text, so pickling it never recurses."""

from __future__ import annotations

import json
import pickle
import sys

import pytest

from conveyor import LLM, SamplingParams
from conveyor.json_depth import MAX_JSON_DEPTH, deep_path, deep_text_path, format_path
from conveyor.structured_params import MAX_SCHEMA_DEPTH, StructuredOutputsParams


def nested_objects(depth: int) -> dict:
    """An object schema `depth` properties deep (2 JSON levels per property, plus the leaf)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_arrays(depth: int) -> dict:
    """An array schema `depth` items deep (1 JSON level each, plus the leaf)."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def deep_text(depth: int, open_: str = '{"a":', close: str = "}") -> str:
    return open_ * depth + "1" + close * depth


@pytest.mark.parametrize(
    ("value", "depth"),
    [(1, 0), ("[[[", 0), ([], 1), ({"a": 1}, 1), ([[1], 2], 2), ({"a": {"b": [1]}}, 3)],
)
def test_depth_counts_objects_and_arrays_and_nothing_else(value, depth) -> None:
    text = json.dumps(value)
    for limit in range(5):
        too_deep = depth > limit
        assert (deep_path(value, limit) is not None) == too_deep, (value, limit)
        assert (deep_text_path(text, limit) is not None) == too_deep, (text, limit)


def test_the_path_names_where_the_first_too_deep_container_is() -> None:
    body = {"model": "m", "tools": [{"x": 1}, {"function": {"parameters": nested_objects(40)}}]}
    text = json.dumps(body)
    path = deep_path(body)
    assert path == deep_text_path(text) == deep_text_path(text.encode())
    assert path[:5] == ("tools", 1, "function", "parameters", "properties")
    assert len(path) == MAX_JSON_DEPTH
    assert format_path(path) == "tools[1].function.parameters.properties.a..."


def test_brackets_and_quotes_inside_strings_do_not_count() -> None:
    text = json.dumps({"prompt": "[{" * 500 + '\\"[' * 100, 'k"[{': ["]}"] * 3})
    assert deep_text_path(text, 2) is None
    assert deep_text_path(text, 1) == ('k"[{',)


def test_nothing_deep_makes_the_check_recurse() -> None:
    for depth in (1_000, 100_000):
        assert deep_text_path("[" * depth + "]" * depth) == (0,) * MAX_JSON_DEPTH
        assert deep_text_path(deep_text(depth))[:2] == ("a", "a")
        value: list = []
        for _ in range(depth):
            value = [value]
        assert deep_path(value) == (0,) * MAX_JSON_DEPTH
    assert deep_text_path("[" * 100_000) is not None  # unterminated: still measured


def test_malformed_text_is_measured_as_far_as_it_goes() -> None:
    assert deep_text_path('{"a": [1, 2', 1) == ("a",)
    # An unterminated string is no string: its brackets count (the body is a 400 either way).
    assert deep_text_path('{"a": "unterminated [[[[', 1) == ("a",)
    assert deep_text_path("]]]}}}", 0) is None


# -------------------------------------------------------------------- structured outputs
@pytest.mark.parametrize("shape", ["objects", "arrays"])
@pytest.mark.parametrize("as_text", [False, True], ids=["dict", "text"])
def test_a_schema_nested_1000_deep_is_a_value_error_naming_the_field(shape, as_text) -> None:
    if shape == "objects":  # as dicts built in a loop: json.loads of the text would recurse
        text = deep_text(1000, '{"type":"object","required":["a"],"properties":{"a":', "}}")
        value: dict | str = nested_objects(1000)
    else:
        text, value = deep_text(1000, '{"type":"array","items":', "}"), nested_arrays(1000)
    if as_text:
        value = text
    with pytest.raises(ValueError, match=r"structured_outputs\.json must nest at most 72"):
        StructuredOutputsParams(json=value)
    with pytest.raises(ValueError, match=r"structured_outputs\.json"):
        SamplingParams(structured_outputs={"json": value})


def test_llm_generate_refuses_a_schema_too_deep(demo_model_dir) -> None:
    llm = LLM(str(demo_model_dir), num_kv_blocks=8)
    deep = nested_arrays(MAX_SCHEMA_DEPTH)  # the leaf makes it one level too deep
    with pytest.raises(ValueError, match=r"structured_outputs\.json"):
        params = SamplingParams(max_tokens=2, structured_outputs={"json": deep})
        llm.generate("x", params, use_tqdm=False)
    out = llm.generate("x", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_schema_crosses_a_pipe_as_text_so_pickling_never_recurses() -> None:
    """Before: pickle walked the schema's dicts, one recursion level each; a 250-deep schema
    raised RecursionError in the engine pipe's writer thread, which then died."""
    deepest = nested_arrays(MAX_SCHEMA_DEPTH - 1)
    params = SamplingParams(structured_outputs={"json": deepest})
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(_frames()) + 40)  # far less than the schema's depth
    try:
        data = pickle.dumps(("add", "r", [1], [1], params, 0.0))
    finally:
        sys.setrecursionlimit(limit)
    back = pickle.loads(data)[4].structured_outputs
    assert back.key == params.structured_outputs.key and back.json == deepest
    for so in (
        StructuredOutputsParams(choice=["a", "b"]),
        StructuredOutputsParams(json_object=True, disable_any_whitespace=False),
        StructuredOutputsParams(regex="a+"),
        StructuredOutputsParams(grammar='root ::= "a"'),
    ):
        assert pickle.loads(pickle.dumps(so)) == so


def _frames() -> list:
    frame, frames = sys._getframe(), []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames
