"""The request fields that constrain the output, as one StructuredOutputsParams.

    response_format      {"type": "text"} | {"type": "json_object"}
                         | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs   vLLM's object: json | json_object | regex | choice | grammar
                         (+ disable_any_whitespace)
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older names

At most one of them may be set. The constraint is checked before the request is queued: in
the server, by the GrammarChecker's worker process (structured/grammar_checker.py: the
limits, the grammar's shape, a compile for the model's vocabulary, all under a deadline and a
memory limit); without one, in the schema pool off the event loop. One that is over a limit,
cannot compile in time, cannot be enforced or allows no output is a 400 naming the field it
came from. A required or named tool_choice's schemas get
the same checks (a 400 naming `tools`). What only the engine finds (a compile past its time
limit, a dead end of the grammar) comes back as a RequestRejectedError, relabelled here with
the request's own field. OpenAI's `"strict": true` is accepted and optional fields stay
optional, as vLLM does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from conveyor.engine.outputs import RequestOutput
from conveyor.entrypoints.async_llm import RequestRejectedError
from conveyor.sampling_params import SamplingParams
from conveyor.server.clients import current_client, request_arrival
from conveyor.server.errors import APIError
from conveyor.server.offload import off_loop, schema_pool
from conveyor.server.tools import ToolSetup
from conveyor.structured.grammar import check_structured_outputs
from conveyor.structured.grammar_checker import (
    GrammarChecker,
    GrammarCheckerUnavailableError,
    TooManyGrammarChecksError,
)
from conveyor.structured.limits import check_constraint
from conveyor.structured_params import StructuredOutputsParams

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


class DeadlinePassedError(Exception):
    """The request's own `deadline` passed while its constraint was being checked: it goes to
    the engine without the constraint (never checked in full), which ends it at once, as any
    request past its deadline (finish_reason "abort")."""


def deadline_at(params: SamplingParams) -> float | None:
    """When the request's own deadline passes (time.monotonic), or None: it counts from the
    request's arrival at the server (clients.request_arrival), as the engine counts it."""
    if params.deadline is None:
        return None
    return (request_arrival() or time.monotonic()) + params.deadline


async def checked_structured_outputs(
    req: Any, grammars: GrammarChecker | None = None, until: float | None = None
) -> tuple[StructuredOutputsParams | None, str | None]:
    """`requested_structured_outputs`, checked (see the module docstring).

    Args:
        grammars: the server's checker (a worker process, time and memory bounded); None:
            checked in the schema pool of this process.
        until: the request's deadline (`deadline_at`): the check is not waited for past it.
    Raises:
        APIError: as requested_structured_outputs, or a constraint refused by the checks
            (400; 429 when the client has too many checks in flight).
        DeadlinePassedError: `until` came first (the constraint must not be used).
    """
    so, param = requested_structured_outputs(req)
    if so is None:
        return None, None
    await _checked(so, None, param, grammars, until)
    return so, param


async def _checked(
    so: StructuredOutputsParams,
    where: str | None,
    param: str,
    grammars: GrammarChecker | None,
    until: float | None,
) -> None:
    """One constraint through the checks; their refusal as the APIError naming `param`."""
    try:
        if grammars is None:
            await off_loop(check_structured_outputs, so, where, pool=schema_pool())
        else:
            check = grammars.check(so, where or f"structured_outputs.{so.kind}", current_client())
            wait_s = None if until is None else until - time.monotonic()
            so.compile_cost = await asyncio.wait_for(check, wait_s)
    except asyncio.TimeoutError:  # wait_for's (TimeoutError itself from Python 3.11)
        raise DeadlinePassedError from None
    except TooManyGrammarChecksError as exc:
        raise APIError(str(exc), param=param, status=429) from exc
    except GrammarCheckerUnavailableError as exc:
        raise APIError(str(exc), param=param, status=503) from exc
    except ValueError as exc:
        raise APIError(str(exc), param=param) from exc


async def checked_tool_constraint(
    tools: ToolSetup | None, grammars: GrammarChecker | None = None, until: float | None = None
) -> StructuredOutputsParams | None:
    """The constraint of the request's tools (ToolSetup.constraint: required, named, and the
    text-or-call grammars of "auto"), its schemas checked like response_format's, then the
    constraint they make together (built in the schema pool).

    Raises:
        APIError: a tool's parameters refused by the checks (400 naming `tools`).
        DeadlinePassedError: as checked_structured_outputs.
    """
    if tools is None or tools.mode == "none":
        return None
    names = list(tools.parameters)
    used = [str(tools.named)] if tools.mode == "named" else names
    for name in used:
        where = f"tools[{names.index(name)}].function.parameters"
        await _checked(StructuredOutputsParams(json=tools.parameters[name]), where, "tools",
                       grammars, until)  # fmt: skip
    try:
        forced = await off_loop(tools.constraint, pool=schema_pool())
        if forced is not None:
            check_constraint(*forced.key[:2], _TOGETHER)
    except ValueError as exc:
        raise APIError(str(exc), param="tools") from exc
    if forced is not None and grammars is not None:
        await _checked(forced, _TOGETHER, "tools", grammars, until)
    return forced


_TOGETHER = "tools (all of them together)"


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
