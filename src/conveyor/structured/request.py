"""The request fields that constrain the output, as one StructuredOutputsParams.

    response_format      {"type": "text"} | {"type": "json_object"}
                         | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs   vLLM's object: json | json_object | regex | choice | grammar
                         (+ disable_any_whitespace)
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older names

At most one of them may be set. The constraint is checked before the request is queued
(structured/limits.py's limits, then turned into an xgrammar grammar, in the schema pool off
the event loop): one that is over a limit, cannot compile, cannot be enforced or allows no
output is a 400 naming the field it came from. A required or named tool_choice's schemas get
the same checks (a 400 naming `tools`). What only the engine finds (a compile past its time
limit, a dead end of the grammar) comes back as a RequestRejectedError, relabelled here with
the request's own field. OpenAI's `"strict": true` is accepted and optional fields stay
optional, as vLLM does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from conveyor.engine.outputs import RequestOutput
from conveyor.entrypoints.async_llm import RequestRejectedError
from conveyor.server.errors import APIError
from conveyor.server.offload import off_loop, schema_pool
from conveyor.server.tools import ToolSetup
from conveyor.structured.grammar import check_structured_outputs
from conveyor.structured.limits import check_constraint
from conveyor.structured.params import StructuredOutputsParams

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


async def checked_structured_outputs(
    req: Any,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """`requested_structured_outputs`, checked in the schema pool (see the module docstring).

    Raises:
        APIError: as requested_structured_outputs, or a constraint refused by the checks.
    """
    so, param = requested_structured_outputs(req)
    if so is None:
        return None, None
    try:
        await off_loop(check_structured_outputs, so, pool=schema_pool())
    except ValueError as exc:
        raise APIError(str(exc), param=param) from exc
    return so, param


async def checked_tool_constraint(tools: ToolSetup | None) -> StructuredOutputsParams | None:
    """The constraint of the request's tools (ToolSetup.constraint: required, named, and the
    text-or-call grammars of "auto"), its schemas checked like response_format's; built and
    checked in the schema pool.

    Raises:
        APIError: a tool's parameters refused by the checks (400 naming `tools`).
    """
    if tools is None or tools.mode == "none":
        return None
    names = list(tools.parameters)
    used = [str(tools.named)] if tools.mode == "named" else names
    checks = [
        (StructuredOutputsParams(json=tools.parameters[name]),
         f"tools[{names.index(name)}].function.parameters")
        for name in used
    ]  # fmt: skip
    try:
        return await off_loop(_check_tools, checks, tools, pool=schema_pool())
    except ValueError as exc:
        raise APIError(str(exc), param="tools") from exc


def _check_tools(
    checks: list[tuple[StructuredOutputsParams, str]], tools: ToolSetup
) -> StructuredOutputsParams | None:
    """Each tool's schema in full; the tools' constraint (all of them) against the limits."""
    for so, where in checks:
        check_structured_outputs(so, where)
    forced = tools.constraint()
    if forced is not None:
        check_constraint(*forced.key[:2], "tools (all of them together)")
    return forced


def relabeled(
    stream: AsyncIterator[RequestOutput], param: str | None
) -> AsyncIterator[RequestOutput]:
    """`stream`, with a RequestRejectedError of its constraint naming the request's `param`
    (the engine knows only "structured_outputs"). Closing it closes `stream` (an abort)."""
    if param is None:
        return stream

    async def outputs() -> AsyncIterator[RequestOutput]:
        try:
            async for out in stream:
                yield out
        except RequestRejectedError as exc:
            if exc.param != "structured_outputs":
                raise
            raise RequestRejectedError(str(exc), param) from None
        finally:
            close = getattr(stream, "aclose", None)  # an async generator's
            if close is not None:
                await close()

    return outputs()
