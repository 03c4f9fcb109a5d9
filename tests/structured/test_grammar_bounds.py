"""A grammar's shape, read before anything runs it (structured/grammar_bounds.py): no finite
sentence, or only very long ones, is refused; the compile-work estimate grows with runs of
optional items the way xgrammar's compile time does."""

from __future__ import annotations

import pytest
from tests.structured.structured_schemas import SCHEMAS

from conveyor.structured.grammar import GrammarError, build_checked, can_start, text_or_json_ebnf
from conveyor.structured.grammar_bounds import (
    INFINITE,
    MAX_SHORTEST_OUTPUT,
    grammar_shape,
)
from conveyor.structured_params import StructuredOutputsParams

xgr = pytest.importorskip("xgrammar")


def _shape(**constraint):
    return build_checked(StructuredOutputsParams(**constraint))[1]


def _doubling(levels: int) -> str:
    """A grammar whose one sentence is "abc" repeated 2**levels times."""
    rules = [f"r{i} ::= r{i - 1} r{i - 1}" for i in range(1, levels + 1)]
    return "\n".join([f"root ::= r{levels}", *rules, 'r0 ::= "abc"'])


INFINITE_GRAMMARS = {
    "self": 'root ::= "a" root',  # issue 49: the server grew to 20.9 GB on this one
    "mutual": 'root ::= a\na ::= "x" b\nb ::= "y" a',
    "through-a-group": 'root ::= ("a" | "b") root',
    "repeat-of-infinite": 'root ::= x{2}\nx ::= "q" x',
    "empty-class": "root ::= [^\\0-\\U0010ffff]",
}


@pytest.mark.parametrize("name", list(INFINITE_GRAMMARS))
def test_a_grammar_with_no_finite_sentence_is_refused(name) -> None:
    with pytest.raises(GrammarError, match="allows no finite output"):
        build_checked(StructuredOutputsParams(grammar=INFINITE_GRAMMARS[name]))


def test_an_empty_regex_is_refused_before_any_compile() -> None:
    with pytest.raises(GrammarError, match=r"structured_outputs\.regex can never be satisfied"):
        build_checked(StructuredOutputsParams(regex=r"(a|b)[^\s\S]"))


def test_the_shortest_sentence_is_counted_through_recursion_and_repeats() -> None:
    assert _shape(grammar='root ::= "a" root | "bc"').shortest == 2
    assert _shape(grammar='root ::= x{3} "!"\nx ::= [a-z]+ | "long"').shortest == 4
    assert _shape(regex="[0-9]{2,5}w+x*").shortest == 3
    assert _shape(grammar='root ::= x | "cd"\nx ::= "a" (= "b")').shortest == 1  # lookahead: 0
    assert _shape(grammar='root ::= "<" Regex("[0-9]{4}") ">"').shortest == 6
    assert _shape(grammar=_doubling(10)).shortest == 3 * 2**10


def test_a_grammar_whose_shortest_sentence_is_too_long_is_refused() -> None:
    """Rules that double each other force 2^k characters from a few hundred bytes."""
    assert 3 * 2**14 <= MAX_SHORTEST_OUTPUT < 3 * 2**15
    assert _shape(grammar=_doubling(14)).shortest == 3 * 2**14
    with pytest.raises(GrammarError, match=f"at most {MAX_SHORTEST_OUTPUT}"):
        build_checked(StructuredOutputsParams(grammar=_doubling(15)))
    with pytest.raises(GrammarError, match="forces an output of at least"):
        build_checked(StructuredOutputsParams(grammar=_doubling(40)))


def test_the_forced_text_of_a_checked_grammar_is_no_longer_than_its_shortest_sentence() -> None:
    """can_start searches the forced text only of checked grammars: bounded by the shape."""
    grammar, shape = build_checked(StructuredOutputsParams(grammar=_doubling(14)))
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)], vocab_type=xgr.VocabType.RAW)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    forced = matcher.find_jump_forward_string()
    assert len(forced) == shape.shortest  # its one sentence
    assert can_start(xgr.GrammarMatcher(compiled, terminate_without_stop_token=True), 256)


def _optional_groups(k: int) -> str:
    return "".join(f"(x{chr(65 + i % 26)})?" for i in range(k))


def test_the_work_estimate_grows_with_the_square_of_an_optional_run() -> None:
    """xgrammar's compile time of `(a)?(b)?...` grows with the square of the run: so does
    the estimate (a run of k optional items predicts k, k-1, ... items at its positions)."""
    small, large = (_shape(regex=_optional_groups(k)).work for k in (100, 200))
    assert 3.5 * small <= large <= 4.5 * small
    plain = _shape(regex="".join(f"(x{chr(65 + i % 26)})" for i in range(200))).work
    assert plain * 20 < large  # the same length, nothing optional


def _all_grammars() -> dict[str, str]:
    grammars: dict[str, str] = {"builtin-json": str(xgr.Grammar.builtin_json_grammar())}
    for model in SCHEMAS:
        grammar, _ = build_checked(StructuredOutputsParams(json=model.model_json_schema()))
        grammars[f"schema-{model.__name__}"] = str(grammar)
    grammars["any-whitespace"] = str(build_checked(StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "array"}}},
        disable_any_whitespace=False))[0])  # fmt: skip
    tool = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    grammars["tool-call"] = text_or_json_ebnf(tool, "{ \n", '{"name": "f", "arguments": ', "}")
    grammars["choice"] = str(build_checked(StructuredOutputsParams(choice=["yes", "no"]))[0])
    grammars["regex"] = str(build_checked(StructuredOutputsParams(
        regex=r"(\d{3}-)?[A-Za-z_\-\]\\]+\.(com|org)"))[0])  # fmt: skip
    return grammars


@pytest.mark.parametrize("name", list(_all_grammars()))
def test_every_grammar_the_server_makes_has_a_readable_finite_shape(name) -> None:
    """The reader knows xgrammar's normalized form of every kind of constraint (an unreadable
    one would skip the forced-text search and the server's cost estimate)."""
    shape = grammar_shape(_all_grammars()[name])
    assert shape.shortest != INFINITE and shape.work > 0


def test_escapes_and_ranges_in_character_classes_are_read() -> None:
    assert _shape(grammar="root ::= [\\-\\]]").shortest == 1
    assert _shape(grammar='root ::= [^\\0-\\x7f] | "a"').shortest == 1
    with pytest.raises(GrammarError, match="no finite output"):
        build_checked(StructuredOutputsParams(grammar='root ::= Regex("[^\\\\s\\\\S]")'))
    assert _shape(json={"type": "string", "maxLength": 3}).shortest == 2  # '""'
