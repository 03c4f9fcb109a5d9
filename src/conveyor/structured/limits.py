"""What an output constraint may be before anything compiles it.

A grammar's compile time grows with its size, and faster than linearly with some shapes (an
object's optional properties: 500 compile in ~0.2 s, 3,000 took 56 s on the demo model), and
xgrammar cannot stop a compile once it started. So the cheap checks come first, in one walk
of the constraint (microseconds to a few milliseconds), each failure a ValueError that names
the field and the limit:

    size        schema / grammar text, regex length, repetition counts {m,n} in a regex
    complexity  properties in all (and optional ones per object), enum and choice entries,
                subschemas
    enforceable what xgrammar would silently ignore is refused: a remote `$ref`, `allOf`
                with several schemas (it becomes any JSON), `uniqueItems`, `dependentRequired`
                / `dependentSchemas`, `format` with a length bound
    satisfiable a schema that can produce no value through what it needs (an `allOf`, a
                `$ref` or a required property that leads back to itself, or to `false`)

The engine's compile time limit (EngineConfig.grammar_compile_timeout) is the backstop for
whatever passes these and is still slow.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_SCHEMA_CHARS = 64 * 1024
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_REGEX_CHARS = 4096
MAX_REPEAT = 1000
MAX_PROPERTIES = 2000
MAX_OPTIONAL_PROPERTIES = 256
MAX_ENUM_VALUES = 10_000
MAX_SUBSCHEMAS = 2000

# Keywords whose value is one subschema, a list of them, or a name -> subschema object.
_ONE = (
    "additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
    "unevaluatedProperties", "unevaluatedItems", "additionalItems",
)  # fmt: skip
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_REPEAT = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


class ConstraintLimitError(ValueError):
    """A constraint over a limit, or one the grammar engine cannot enforce or satisfy."""


def check_constraint(kind: str, spec: str, where: str, num_choices: int = 0) -> None:
    """Raise ConstraintLimitError unless the constraint is within every limit above.

    Args:
        kind: "json", "json_object", "regex", "choice" or "grammar".
        spec: its canonical text (StructuredOutputsParams.spec).
        where: the field named in messages, e.g. "structured_outputs.json".
        num_choices: the number of strings of a choice.
    """
    if kind == "json":
        _check_size(where, len(spec), MAX_SCHEMA_CHARS)
        try:
            schema = json.loads(spec)
        except RecursionError:
            raise ConstraintLimitError(f"{where} is nested too deeply.") from None
        check_schema(schema, where)
    elif kind == "regex":
        _check_size(where, len(spec), MAX_REGEX_CHARS)
        check_repeats(spec, where)
    elif kind == "grammar":
        _check_size(where, len(spec), MAX_GRAMMAR_CHARS)
        check_repeats(_without_quoted(spec), where)
    elif kind == "choice":
        _check_count(where, "strings", num_choices, MAX_ENUM_VALUES)
        _check_size(where, len(spec), MAX_SCHEMA_CHARS)


def _check_size(where: str, size: int, limit: int) -> None:
    if size > limit:
        raise ConstraintLimitError(
            f"{where} must be at most {limit} characters on this server, got {size}."
        )


def _check_count(where: str, what: str, count: int, limit: int) -> None:
    if count > limit:
        raise ConstraintLimitError(
            f"{where} may hold at most {limit} {what} on this server, got {count}."
        )


def check_repeats(regex: str, where: str) -> None:
    """Refuse a repetition count above MAX_REPEAT (`a{5000}` expands to 5,000 states)."""
    i, n, in_class = 0, len(regex), False
    while i < n:
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if regex[i + 1 : i + 2] == "]":  # "[]...]": the first "]" is a literal
                i += 1
        elif c == "{":
            m = _REPEAT.match(regex, i)
            if m is not None:
                bound = max((int(b) for b in m.groups() if b), default=0)
                if bound > MAX_REPEAT:
                    raise ConstraintLimitError(
                        f"{where} repeats a part {bound} times ({m.group(0)}); this server "
                        f"allows at most {MAX_REPEAT} (MAX_REPEAT) repetitions."
                    )
        i += 1


def _without_quoted(ebnf: str) -> str:
    """EBNF text with its string literals blanked (a literal "{9999}" is no repetition)."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', ebnf)


def check_schema(schema: Any, where: str) -> None:
    """The limits, the enforceability and the satisfiability of one JSON schema."""
    nodes: dict[str, Any] = {}  # JSON pointer -> subschema
    stack = [("#", schema)]
    num_properties = num_enum = 0
    while stack:
        pointer, node = stack.pop()
        nodes[pointer] = node
        _check_count(where, "subschemas", len(nodes), MAX_SUBSCHEMAS)
        if not isinstance(node, dict):
            continue
        _check_keywords(node, pointer, where)
        props = node.get("properties")
        if isinstance(props, dict):
            num_properties += len(props)
            _check_count(where, "properties in all", num_properties, MAX_PROPERTIES)
            required = node.get("required")
            required = set(required) if isinstance(required, list) else set()
            optional = sum(1 for name in props if name not in required)
            _check_count(where, "optional properties in one object (those not in `required`)",
                         optional, MAX_OPTIONAL_PROPERTIES)  # fmt: skip
        if isinstance(node.get("enum"), list):
            num_enum += len(node["enum"])
            _check_count(where, "enum values in all", num_enum, MAX_ENUM_VALUES)
        if isinstance(node.get("pattern"), str):
            _check_size(f"{where} (a pattern)", len(node["pattern"]), MAX_REGEX_CHARS)
            check_repeats(node["pattern"], f"{where} (a pattern)")
        for key, value in _children(node):
            stack.append((f"{pointer}/{key}", value))
    if not _productive(nodes):
        raise ConstraintLimitError(
            f"{where} can never be satisfied: it needs (through a $ref, an allOf or a "
            "required property) a schema that accepts no value: `false`, or one that only "
            "refers back to itself."
        )


def _children(node: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for key in _ONE:
        if isinstance(node.get(key), (dict, bool)):
            out.append((key, node[key]))
    for key in _LIST:
        if isinstance(node.get(key), list):
            out += [(f"{key}/{i}", v) for i, v in enumerate(node[key])]
    for key in _MAP:
        if isinstance(node.get(key), dict):
            out += [(f"{key}/{_escape(k)}", v) for k, v in node[key].items()]
    return out


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _check_keywords(node: dict[str, Any], pointer: str, where: str) -> None:
    """Refuse what xgrammar would drop without a word, so the output would not match."""
    at = f"{where} at {pointer}"
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise ConstraintLimitError(
            f"{at}: $ref {str(ref)[:100]!r} cannot be enforced: only references inside the "
            "schema (starting with '#') are followed; nothing is fetched."
        )
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise ConstraintLimitError(
            f"{at}: allOf with {len(node['allOf'])} schemas cannot be enforced (the grammar "
            "engine does not intersect schemas); merge them into one schema."
        )
    refused = None
    if node.get("uniqueItems") is True:
        refused = "uniqueItems"
    elif node.get("dependentRequired") or node.get("dependentSchemas"):
        refused = "dependentRequired" if node.get("dependentRequired") else "dependentSchemas"
    elif "format" in node and ("minLength" in node or "maxLength" in node):
        refused = "format together with minLength/maxLength"
    if refused is not None:
        raise ConstraintLimitError(f"{at}: {refused} cannot be enforced; leave it out.")


def _productive(nodes: dict[str, Any]) -> bool:
    """Whether the root schema can produce some value: a least fixpoint over its nodes,
    worked off a queue (each dependency is counted down once, so it is linear).

    Only references decide it: a node needs every one of its $ref target, its allOf
    schemas and its required properties' schemas, and one schema of each anyOf / oneOf;
    `false` never is. Every other keyword is taken as satisfiable (a `false` property that is
    required, say, xgrammar reports itself).
    """
    need: dict[str, int] = {}
    dependents: dict[str, list[tuple[str, int]]] = {}  # q -> (p, group) that wait on q
    ready: list[str] = []
    for pointer, node in nodes.items():
        if node is False:
            continue
        groups = _dependencies(pointer, node, nodes) if isinstance(node, dict) else []
        need[pointer] = len(groups)
        for g, group in enumerate(groups):
            for q in group:
                dependents.setdefault(q, []).append((pointer, g))
        if not groups:
            ready.append(pointer)
    done: set[tuple[str, int]] = set()  # (p, group) already satisfied
    productive: set[str] = set()
    while ready:
        q = ready.pop()
        if q in productive:
            continue
        productive.add(q)
        for p, g in dependents.get(q, ()):
            if (p, g) not in done:
                done.add((p, g))
                need[p] -= 1
                if need[p] == 0:
                    ready.append(p)
    return "#" in productive


def _dependencies(pointer: str, node: dict[str, Any], nodes: dict[str, Any]) -> list[list[str]]:
    """The groups of nodes `node` waits on: it needs one node of every group."""
    groups: list[list[str]] = []
    ref = node.get("$ref")
    if isinstance(ref, str) and _resolve(ref) in nodes:  # an unknown one xgrammar reports
        groups.append([_resolve(ref)])
    if isinstance(node.get("allOf"), list):
        groups += [[f"{pointer}/allOf/{i}"] for i in range(len(node["allOf"]))]
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key]:
            groups.append([f"{pointer}/{key}/{i}" for i in range(len(node[key]))])
    props, required = node.get("properties"), node.get("required")
    if isinstance(props, dict) and isinstance(required, list):
        names = dict.fromkeys(n for n in required if isinstance(n, str) and n in props)
        groups += [[f"{pointer}/properties/{_escape(n)}"] for n in names]
    return groups


def _resolve(ref: str) -> str:
    """A local $ref as the pointer the walk gave that node ("#", "#/$defs/a", ...)."""
    return ref.rstrip("/") if ref != "#/" else "#"
