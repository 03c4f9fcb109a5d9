"""Grammars of structured outputs: checked, compiled off the engine step, matched.

    server (schema pool)      check_structured_outputs: the limits (structured/limits.py),
                              then schema -> xgrammar Grammar (no tokenizer, ~1 ms) and, for
                              a small one, whether it allows any output at all: a bad one is
                              a 400 there
    engine add_request  ───►  GrammarCache.get(params) (grammar_cache.py): a job, compiled in
                              a lane of threads; the request waits outside the scheduler
    engine step start   ───►  ready requests join the scheduler with a RequestGrammar (matcher)
    sampler             ───►  one bitmask for the batch, applied to the constrained rows
    engine update       ───►  the matcher accepts the new token; terminated: finish "stop";
                              a grammar that allows no token at all: the request's own 400

Why compile in the engine process's own threads rather than in the server's pool: a compiled
grammar is tied to its TokenizerInfo and would have to be serialised across the process pipe
(tens of MB and seconds for a large schema that compiles in a tenth of a second:
docs/kernels.md#measured-choices);
compiling where it is used keeps the pipe carrying only the spec. xgrammar releases the GIL
while it compiles, so the engine step runs on meanwhile. xgrammar is imported on first use
(about 1 s): engines that never see a constraint skip it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import TYPE_CHECKING

from conveyor.structured.grammar_bounds import (
    GrammarShape,
    GrammarShapeError,
    NoFiniteOutputError,
    check_grammar_shape,
)
from conveyor.structured.limits import check_constraint
from conveyor.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# Compact JSON: no free whitespace anywhere, and none after separators either.
_COMPACT_SEPARATORS = (",", ":")
# xgrammar's messages start with "[time] /path/file.cc:line: ".
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
# xgrammar 0.2.9 writes the characters of a length-bounded JSON string (minLength /
# maxLength) as [^"\\\r\n], which lets raw control characters in: invalid JSON that no
# parser takes (measured: 26 of 264 demo-model outputs). They become [^\0-\x1f"\\] here.
_BOUNDED_STRING_CHARS = r"[^\"\\\r\n]"
_JSON_STRING_CHARS = r"[^\0-\x1f\"\\]"
# Constraints up to this long are "small": the server also checks that they allow some
# output, and the engine compiles them in its small lane (never behind a big one).
SMALL_SPEC_CHARS = 4096


class GrammarError(ValueError):
    """A constraint that xgrammar cannot turn into a grammar (the request's own fault)."""


class GrammarUnsatisfiableError(GrammarError):
    """A grammar that allows no output, at its start or after the tokens so far."""


class GrammarTimeoutError(GrammarError):
    """A grammar that did not compile within the engine's grammar_compile_timeout."""


def build_grammar(so: StructuredOutputsParams, where: str | None = None) -> xgr.Grammar:
    """The xgrammar Grammar of a constraint (tokenizer-independent), its shape checked:
    ConstraintLimitError over a limit of structured/limits.py, GrammarError if invalid,
    unsupported, or allowing no finite output (grammar_bounds.py). Errors name `where`."""
    return build_checked(so, where)[0]


def build_checked(
    so: StructuredOutputsParams, where: str | None = None
) -> tuple[xgr.Grammar, GrammarShape | None]:
    """`build_grammar`, with the grammar's shape (None: a normalized form the shape reader
    does not know, so its forced text is not searched: see `can_start`)."""
    where = where or f"structured_outputs.{so.kind}"
    grammar = _build(so, where)
    try:
        shape = check_grammar_shape(str(grammar), where)
    except NoFiniteOutputError as exc:
        raise GrammarUnsatisfiableError(str(exc)) from None
    except GrammarShapeError as exc:
        raise GrammarError(str(exc)) from None
    except ValueError:
        logger.warning("%s: the grammar's shape could not be read; its forced text is not "
                       "searched.", where)  # fmt: skip
        shape = None
    return grammar, shape


def _build(so: StructuredOutputsParams, where: str) -> xgr.Grammar:
    import xgrammar as xgr

    kind, spec, compact = so.key
    check_constraint(kind, spec, where, len(so.choice or ()))
    separators = _COMPACT_SEPARATORS if compact else None
    try:
        if kind in ("json", "json_object"):
            grammar = xgr.Grammar.from_json_schema(
                spec if kind == "json" else '{"type": "object"}',
                any_whitespace=not compact,
                separators=separators,
                strict_mode=kind == "json",
            )
            ebnf = str(grammar)
            if _BOUNDED_STRING_CHARS not in ebnf:
                return grammar
            return xgr.Grammar.from_ebnf(ebnf.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS))
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice or ())
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        message = _LOCATION.sub("", str(exc)).strip()
        raise GrammarError(f"{where} cannot be compiled: {message}") from None


def check_structured_outputs(so: StructuredOutputsParams | None, where: str | None = None) -> None:
    """Raise a ValueError unless `so` is None, within the limits, compiles, and (when it is
    small) allows some output.

    The last check compiles the grammar for a vocabulary of the 256 single bytes: about as
    cheap as building it for a small constraint, so it runs only for those (the engine checks
    every compiled grammar the same way, for its own tokenizer). It sees dead ends at the
    start and after the text the grammar forces there; a later one the engine finds when the
    output reaches it. The server runs this in a worker process under time and memory limits
    instead (structured/grammar_checker.py), compiling for the model's own vocabulary;
    `LLM` and `AsyncLLM` without a server run it in the caller's process.
    """
    if so is None:
        return
    grammar, shape = build_checked(so, where)
    if len(so.spec) <= SMALL_SPEC_CHARS:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(
            _byte_compiler().compile_grammar(grammar), terminate_without_stop_token=True
        )
        if not can_start(matcher, 256, search_forced=shape is not None):
            where = where or f"structured_outputs.{so.kind}"
            raise GrammarUnsatisfiableError(
                f"{where} can never be satisfied: no output matches it."
            )


_byte_lock = threading.Lock()
_byte_compilers: list[xgr.GrammarCompiler] = []


def _byte_compiler() -> xgr.GrammarCompiler:
    """A compiler for the vocabulary of the 256 single bytes (built once, thread-safe)."""
    with _byte_lock:
        if not _byte_compilers:
            import xgrammar as xgr

            info = xgr.TokenizerInfo([bytes([i]) for i in range(256)], vocab_type=xgr.VocabType.RAW)
            _byte_compilers.append(
                xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=16 << 20)
            )
        return _byte_compilers[0]


def can_start(matcher: xgr.GrammarMatcher, vocab_size: int, search_forced: bool = True) -> bool:
    """Whether a fresh matcher's grammar allows a token, or is complete, past the text it
    forces (the matcher moves on: give it a throwaway one). That text is searched only where
    the grammar's shape was checked (`search_forced`), which bounds it; an unchecked grammar's
    may go on until memory runs out."""
    forced = matcher.find_jump_forward_string() if search_forced else ""
    if forced and not matcher.accept_string(forced):
        return False
    return allows_any_token(matcher, vocab_size)


def allows_any_token(matcher: xgr.GrammarMatcher, vocab_size: int) -> bool:
    """Whether the matcher can go on from where it is: some token allowed next, or done."""
    import xgrammar as xgr

    if matcher.is_terminated():
        return True
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


class GrammarRejectedError(RuntimeError):
    """A sampled token the request's grammar does not allow (its mask was bypassed)."""


class RequestGrammar:
    """One sequence's matcher, kept in step with its output tokens.

    Invariant: the matcher has accepted exactly `output_token_ids[:num_accepted]`. `sync`
    restores it whatever happened to the tokens: new ones are accepted; fewer tokens than
    accepted (outputs rolled back) rebuild the matcher from scratch and replay them. A
    recompute after preemption keeps the outputs (only their KV is recomputed), so the
    matcher stays valid across it without a rebuild.
    """

    __slots__ = ("matcher", "num_accepted", "vocab_size")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0
        self.vocab_size = compiled.tokenizer_info.vocab_size

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept the outputs the matcher has not seen.

        Raises:
            GrammarUnsatisfiableError: the grammar allows no token at all where one broke it
                (a dead end of the constraint: the request's own fault).
            GrammarRejectedError: one of them breaks the grammar otherwise.
        """
        n = self.num_accepted
        if n == len(output_token_ids):
            return
        if n > len(output_token_ids):
            self.matcher.reset()
            n = 0
        for token_id in output_token_ids[n:]:
            if not self.matcher.accept_token(token_id):
                self.num_accepted = n
                if not allows_any_token(self.matcher, self.vocab_size):
                    raise GrammarUnsatisfiableError(
                        "structured_outputs can never be satisfied: after "
                        f"{n} token(s) it allows no further output."
                    )
                raise GrammarRejectedError(f"token {token_id} breaks the request's grammar")
            n += 1
        self.num_accepted = n

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()


def text_or_json_ebnf(schema: dict, not_first: str, prefix: str = "", suffix: str = "") -> str:
    """The EBNF of an answer that is either plain text or `prefix` + compact JSON valid against
    `schema` + `suffix` (a tool-call format, server/tools.py).

    The text may be empty; otherwise its first character is none of `not_first` (the start of
    the JSON form, and blanks), so text and a call can never be confused.
    """
    import xgrammar as xgr

    call = build_grammar(StructuredOutputsParams(json=schema))
    parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(p)}") for p in (prefix,) if p]
    parts.append(call)
    parts += [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(s)}") for s in (suffix,) if s]
    if len(parts) > 1:
        call = xgr.Grammar.concat(*parts)
    excluded = "".join(_CLASS_ESCAPES.get(c, c) for c in not_first)
    text = xgr.Grammar.from_ebnf(f'root ::= "" | [^{excluded}] [\\0-\\U0010ffff]*')
    return str(xgr.Grammar.union(text, call))


_CLASS_ESCAPES = {" ": " ", "\t": "\\t", "\r": "\\r", "\n": "\\n", "[": "\\[", "]": "\\]",
                  "\\": "\\\\", "^": "\\^", "-": "\\-"}  # fmt: skip
