"""The request fields that constrain the output, as one StructuredOutputsParams.

    response_format      {"type": "text"} | {"type": "json_object"}
                         | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs   vLLM's object: json | json_object | regex | choice | grammar
                         (+ disable_any_whitespace)
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older names

At most one of them may be set. The constraint is checked (turned into an xgrammar grammar,
off the event loop) before the request is queued: one that cannot compile is a 400 naming the
field it came from. OpenAI's `"strict": true` is accepted and optional fields stay optional,
as vLLM does.
"""

from __future__ import annotations

from typing import Any

from conveyor.engine.grammar import GrammarError, check_structured_outputs
from conveyor.server.errors import APIError
from conveyor.server.offload import off_loop
from conveyor.structured_outputs import StructuredOutputsParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _from_response_format(value: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError('response_format of type "json_schema" needs a `json_schema` object.')
        schema = spec.get("schema")
        if schema is None:  # OpenAI allows no schema: any JSON object
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=schema)
    raise ValueError(
        f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}.'
    )


def requested_structured_outputs(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from ((None, None) when unconstrained).

    Raises:
        APIError: more than one constraint, or a malformed one (400 naming the field).
    """
    found: list[tuple[StructuredOutputsParams, str]] = []
    try:
        param = "response_format"
        if req.response_format is not None:
            so = _from_response_format(req.response_format)
            if so is not None:
                found.append((so, param))
        param = "structured_outputs"
        if req.structured_outputs is not None:
            found.append((StructuredOutputsParams.from_dict(req.structured_outputs), param))
        for param, kind in _GUIDED.items():
            value = getattr(req, param)
            if value is not None:
                found.append((StructuredOutputsParams(**{kind: value}), param))
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), param=param) from exc
    if len(found) > 1:
        names = ", ".join(p for _, p in found)
        raise APIError(f"Give at most one output constraint, got {names}.", param=found[1][1])
    return found[0] if found else (None, None)


async def checked_structured_outputs(req: Any) -> StructuredOutputsParams | None:
    """`requested_structured_outputs`, compiled to a grammar off the loop to check it.

    Raises:
        APIError: as requested_structured_outputs, or a constraint that cannot compile.
    """
    so, param = requested_structured_outputs(req)
    if so is None:
        return None
    try:
        await off_loop(check_structured_outputs, so)
    except GrammarError as exc:
        raise APIError(str(exc), param=param) from exc
    return so
