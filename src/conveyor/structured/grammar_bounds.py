"""What a grammar costs before anything runs it: its shortest output, and its compile work.

Both come from xgrammar's normalized EBNF (`str(grammar)`), one line a rule, in one linear
pass over it, so they are cheap for any grammar the size limits let through.

    shortest output   the fewest characters of a sentence of each rule (Knuth's
                      generalization of Dijkstra to grammars: a rule is final when it is
                      the smallest one left). A root with no finite sentence
                      (`root ::= "a" root`) is refused: xgrammar's forced-text search would
                      follow it forever, growing without bound. A root whose shortest
                      sentence is longer than MAX_SHORTEST_OUTPUT is refused too: the forced
                      text alone could be that long (rules that double each other reach
                      2^40 characters in a few hundred bytes).
    compile work      each position of each sequence, times the items an Earley parser
                      predicts there: itself plus the nullable ones after it. A run of k
                      optional items costs ~k^2/2, which is what makes `(a)?(b)?...` regexes
                      slow to compile (docs/kernels.md#measured-choices). The cost in
                      "position-tokens" is this count times the vocabulary's size.

    rule      ::= body [ (= lookahead) ]         lookaheads are ignored (0 characters)
    body      ::= alt ("|" alt)*
    alt       ::= item*
    item      ::= atom ("*" | "+" | "?" | "{m}" | "{m,n}" | "{m,}")*
    atom      ::= "string" | [class] | name | "(" body ")"
"""

from __future__ import annotations

import heapq
import json
import re
from dataclasses import dataclass, field

# The longest shortest sentence a grammar may have (characters).
MAX_SHORTEST_OUTPUT = 1 << 16
# Compile cost: work (below) times the vocabulary's size, about 3-6e-10 s each on a 2-core
# Zen 4 (docs/kernels.md#measured-choices). Up to CHEAP a grammar compiles in the fast lanes
# (the server's express lane, the engine's small lane); past MAX it is refused uncompiled.
CHEAP_COMPILE_COST = 1e9
MAX_COMPILE_COST = 5e10
INFINITE = float("inf")

_TOKEN = re.compile(
    r"""
    \s*(?:
      (?P<string>"(?:[^"\\]|\\.)*")
    | (?P<cls>\[(?:[^\]\\]|\\.)*\])
    | (?P<regex>Regex\(\s*"(?:[^"\\]|\\.)*"\s*(?:,[^()]*)?\))
    | (?P<repeat>\{\s*\d*\s*(?:,\s*-?\d*\s*)?\})
    | (?P<define>::=)
    | (?P<look>\(=)
    | (?P<op>[()|*+?])
    | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
    )""",
    re.VERBOSE,
)
_ESCAPE = re.compile(r"\\(?:x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)")
_ESCAPES = {"n": 10, "r": 13, "t": 9, "f": 12, "v": 11, "0": 0, "b": 8, "e": 27, "a": 7}
MAX_CODEPOINT = 0x10FFFF


class GrammarShapeError(ValueError):
    """A grammar whose every sentence is infinite or too long (the request's own fault)."""


class NoFiniteOutputError(GrammarShapeError):
    """A grammar with no finite sentence at all."""


@dataclass(slots=True)
class _Alt:
    """One alternative: a constant length plus items that wait on other rules."""

    owner: int
    const: float = 0
    needs: list[tuple[int, int]] = field(default_factory=list)  # (rule, multiplier)
    waiting: int = 0
    # Every item as (rule or -1, its own length when not a rule, its least repeat count).
    items: list[tuple[int, float, int]] = field(default_factory=list)


@dataclass(slots=True)
class GrammarShape:
    """The measures of one grammar (see the module docstring)."""

    shortest: float  # characters of the root's shortest sentence (INFINITE: none is finite)
    work: int  # positions times their predicted items


class _Parser:
    """Reads normalized EBNF into alternatives; nested groups become rules of their own."""

    def __init__(self, text: str) -> None:
        self.tokens = _tokenize(text)
        self.pos = 0
        self.ids: dict[str, int] = {}
        self.alts: list[_Alt] = []
        self.defined: set[int] = set()
        self.nested_work = 0  # of the Regex(...) items, each read as a grammar of its own

    def rule_id(self, name: str) -> int:
        return self.ids.setdefault(name, len(self.ids))

    def parse(self) -> None:
        toks = self.tokens
        while self.pos < len(toks):
            kind, value = toks[self.pos]
            if kind != "name" or self.pos + 1 >= len(toks) or toks[self.pos + 1][0] != "define":
                raise ValueError(f"unexpected {value!r} in the normalized grammar")
            rule = self.rule_id(value)
            self.defined.add(rule)
            self.pos += 2
            self.body(rule)
            if self.peek() == ("look", "(="):
                self.pos += 1
                self.body(self.rule_id(f"\0look{self.pos}"))
                self.expect(")")

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expect(self, value: str) -> None:
        tok = self.peek()
        if tok is None or tok[1] != value:
            raise ValueError(f"expected {value!r} in the normalized grammar")
        self.pos += 1

    def at_item(self) -> bool:
        tok = self.peek()
        if tok is None:
            return False
        kind, value = tok
        if kind == "name":  # a name followed by ::= starts the next rule
            nxt = self.tokens[self.pos + 1] if self.pos + 1 < len(self.tokens) else None
            return nxt is None or nxt[0] != "define"
        return kind in ("string", "cls", "regex") or value == "("

    def body(self, rule: int) -> None:
        self.alt(rule)
        while self.peek() == ("op", "|"):
            self.pos += 1
            self.alt(rule)

    def alt(self, rule: int) -> None:
        alt = _Alt(rule)
        while self.at_item():
            self.item(alt)
        self.alts.append(alt)

    def item(self, alt: _Alt) -> None:
        """Adds one item to `alt`: a constant length, or a rule it needs (with its count)."""
        kind, value = self.tokens[self.pos]
        self.pos += 1
        target = -1
        length: float = 0
        if kind == "string":
            length = _string_length(value)
        elif kind == "cls":
            length = 1 if _class_nonempty(value) else INFINITE
        elif kind == "regex":  # Regex("pattern", ...): xgrammar's macro, in JSON schemas too
            nested = _regex_shape(value)
            length = nested.shortest
            self.nested_work += nested.work
        elif kind == "name":
            target = self.rule_id(value)
        else:  # "(" body ")": a rule of its own
            target = self.rule_id(f"\0group{self.pos}")
            self.body(target)
            self.expect(")")
        low = 1
        while (tok := self.peek()) is not None and (tok[0] == "repeat" or tok[1] in "*+?"):
            self.pos += 1
            if tok[1] in ("*", "?"):
                low = 0
            elif tok[0] == "repeat":
                lo = tok[1].strip("{} ").split(",")[0].strip()
                low *= int(lo) if lo else 0
        alt.items.append((target, length, low))
        if low == 0:
            return
        if target < 0:
            alt.const += length * low
        else:
            alt.needs.append((target, low))


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos, end = 0, len(text)
    while pos < end:
        m = _TOKEN.match(text, pos)
        if m is None:
            if text[pos:].strip() == "":
                break
            raise ValueError(f"cannot read the normalized grammar at {text[pos : pos + 20]!r}")
        kind = m.lastgroup or ""
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    return tokens


def _string_length(literal: str) -> int:
    """Characters of a quoted literal (an escape counts as one)."""
    return len(_ESCAPE.sub("x", literal[1:-1]))


def _class_nonempty(cls: str) -> bool:
    """Whether a character class `[...]` matches some code point."""
    body = cls[1:-1]
    negated = body.startswith("^")
    points = _class_points(body[1:] if negated else body)
    ranges: list[tuple[int, int]] = []
    j = 0
    while j < len(points):
        if j + 2 < len(points) and points[j + 1][1] and not points[j][1]:  # "a-z"
            ranges.append((points[j][0], points[j + 2][0]))
            j += 3
        else:
            ranges.append((points[j][0], points[j][0]))
            j += 1
    ranges = [(lo, hi) for lo, hi in ranges if lo <= hi]
    if not negated:
        return bool(ranges)
    covered = 0  # the first code point not yet covered
    for lo, hi in sorted(ranges):
        if lo > covered:
            return True
        covered = max(covered, hi + 1)
    return covered <= MAX_CODEPOINT


def _class_points(body: str) -> list[tuple[int, bool]]:
    """A class body's characters in order, each with whether it is an unescaped "-"."""
    points: list[tuple[int, bool]] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            e = body[i + 1]
            width = {"x": 2, "u": 4, "U": 8}.get(e)
            if width is not None and i + 2 + width <= len(body):
                points.append((int(body[i + 2 : i + 2 + width], 16), False))
                i += 2 + width
            else:
                points.append((_ESCAPES.get(e, ord(e)), False))
                i += 2
        else:
            points.append((ord(c), c == "-"))
            i += 1
    return points


def grammar_shape(ebnf: str, root: str = "root") -> GrammarShape:
    """The shortest output and compile work of a normalized grammar (str(xgr.Grammar)).

    Raises:
        ValueError: the text is not xgrammar's normalized EBNF (a bug, not the request's).
    """
    parser = _Parser(ebnf)
    parser.parse()
    shortest = _shortest(parser.alts, len(parser.ids))
    root_id = parser.ids.get(root)
    return GrammarShape(
        shortest=INFINITE if root_id is None else shortest[root_id],
        work=_work(parser.alts, shortest) + parser.nested_work,
    )


def _regex_shape(macro: str) -> GrammarShape:
    """The shape of a `Regex("pattern", ...)` item: its pattern as xgrammar's grammar."""
    import xgrammar as xgr

    literal = macro[macro.index('"') : macro.rindex('"') + 1]
    try:
        pattern = json.loads(literal)
        grammar = xgr.Grammar.from_regex(pattern)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"cannot read {macro[:60]!r}: {exc}") from None
    return grammar_shape(str(grammar))


def _work(alts: list[_Alt], shortest: list[float]) -> int:
    """Positions times the items predicted there: itself and the nullable items after it."""
    total = 0
    for alt in alts:
        run = 0
        for target, length, low in reversed(alt.items):
            empty = low == 0 or (shortest[target] if target >= 0 else length) == 0
            run = run + 1 if empty else 1
            total += run
    return total


def _shortest(alts: list[_Alt], num_rules: int) -> list[float]:
    """Each rule's shortest sentence (Knuth 1977): an alternative is ready once every rule it
    needs is final; the smallest ready value finalizes its rule."""
    best = [INFINITE] * num_rules
    final = [False] * num_rules
    waiting_on: list[list[int]] = [[] for _ in range(num_rules)]
    heap: list[tuple[float, int]] = []
    for index, alt in enumerate(alts):
        alt.waiting = len(alt.needs)
        for rule, _ in alt.needs:
            waiting_on[rule].append(index)
        if not alt.needs:
            heapq.heappush(heap, (alt.const, alt.owner))
    while heap:
        value, rule = heapq.heappop(heap)
        if final[rule]:
            continue
        final[rule] = True
        best[rule] = value
        for index in waiting_on[rule]:
            alt = alts[index]
            alt.waiting -= 1
            if alt.waiting == 0:
                total = alt.const + sum(best[r] * m for r, m in alt.needs)
                heapq.heappush(heap, (total, alt.owner))
    return best


def check_grammar_shape(ebnf: str, where: str) -> GrammarShape:
    """`grammar_shape`, refusing a grammar with no finite sentence or only very long ones.

    Raises:
        GrammarShapeError: the message names `where` and what is wrong.
    """
    shape = grammar_shape(ebnf)
    if shape.shortest == INFINITE:
        raise NoFiniteOutputError(
            f"{where} can never be satisfied: it allows no finite output (every sentence "
            "goes on forever, or needs a character class that matches nothing)."
        )
    if shape.shortest > MAX_SHORTEST_OUTPUT:
        raise GrammarShapeError(
            f"{where} forces an output of at least {int(shape.shortest)} characters; this "
            f"server allows grammars whose shortest output is at most {MAX_SHORTEST_OUTPUT}."
        )
    return shape
