"""Grammars of structured outputs: checked, compiled off the engine step, cached, matched.

    server (event loop)       check_structured_outputs: schema -> xgrammar Grammar (no
                              tokenizer, ~1 ms, off the loop): a bad one is a 400 there
    engine add_request  ───►  GrammarCache.get(params): a Future, compiled in the cache's own
                              thread; the request waits outside the scheduler until it is done
    engine step start   ───►  ready requests join the scheduler with a RequestGrammar (matcher)
    sampler             ───►  one bitmask for the batch, applied to the constrained rows
    engine update       ───►  the matcher accepts the new token; terminated: finish "stop"

Why compile in the engine process's own thread rather than in the server's pool: a compiled
grammar is tied to its TokenizerInfo and would have to be serialised across the process pipe;
compiling where it is used keeps the pipe carrying only the spec. The engine step never waits
on a compile unless nothing else can run (then it waits briefly instead of spinning).
xgrammar is imported on first use (about 1 s): engines that never see a constraint skip it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from conveyor.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

# Compact JSON: no free whitespace anywhere, and none after separators either.
_COMPACT_SEPARATORS = (",", ":")
# xgrammar's messages start with "[time] /path/file.cc:line: ".
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
# xgrammar 0.2.9 writes the characters of a length-bounded JSON string (minLength /
# maxLength) as [^"\\\r\n], which lets raw control characters in: invalid JSON that no
# parser takes (measured: 26 of 264 demo-model outputs). They become [^\0-\x1f"\\] here.
_BOUNDED_STRING_CHARS = r"[^\"\\\r\n]"
_JSON_STRING_CHARS = r"[^\0-\x1f\"\\]"


class GrammarError(ValueError):
    """A constraint that xgrammar cannot turn into a grammar."""


def build_grammar(so: StructuredOutputsParams) -> xgr.Grammar:
    """The xgrammar Grammar of a constraint (tokenizer-independent).

    Raises:
        GrammarError: the schema, regex or grammar is invalid or unsupported; the message
            names the `structured_outputs` field.
    """
    import xgrammar as xgr

    kind, spec, compact = so.key
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
        raise GrammarError(f"structured_outputs.{kind} cannot be compiled: {message}") from None


def check_structured_outputs(so: StructuredOutputsParams | None) -> None:
    """Raise GrammarError (a ValueError) unless `so` is None or compiles."""
    if so is not None:
        build_grammar(so)


class GrammarCache:
    """Compiles grammars in one background thread, keeping the latest `max_entries`.

    Args:
        hf_tokenizer: the transformers tokenizer the model's tokens come from.
        vocab_size: the width of the model's logits (it may exceed the tokenizer's size; the
            extra ids are never allowed).
        stop_token_ids: tokens that end a request where the grammar is complete.
        max_entries: compiled grammars kept (least recently used dropped first).
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        max_entries: int = 256,
    ) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._max_entries = max_entries
        self._compiler: xgr.GrammarCompiler | None = None  # built on first use, in the thread
        self._executor: ThreadPoolExecutor | None = None
        self._futures: OrderedDict[tuple[str, str, bool], Future[xgr.CompiledGrammar]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        self.num_queries = 0
        self.num_hits = 0
        self.num_compiles = 0
        self.compile_time_s = 0.0  # total seconds spent compiling (the tokenizer info included)

    def get(self, so: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `so`, as a Future (done at once on a cache hit)."""
        key = so.key
        with self._lock:
            self.num_queries += 1
            future = self._futures.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self.num_hits += 1
                self._futures.move_to_end(key)
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="conveyor-grammar")
            future = self._executor.submit(self._compile, so)
            self._futures[key] = future
            while len(self._futures) > self._max_entries:
                self._futures.popitem(last=False)
            return future

    def _compile(self, so: StructuredOutputsParams) -> xgr.CompiledGrammar:
        import xgrammar as xgr

        start = time.perf_counter()
        try:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._hf_tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids or None,
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler.compile_grammar(build_grammar(so))
        finally:
            with self._lock:
                self.num_compiles += 1
                self.compile_time_s += time.perf_counter() - start

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


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

    __slots__ = ("matcher", "num_accepted")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept the outputs the matcher has not seen.

        Raises:
            GrammarRejectedError: one of them breaks the grammar.
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
                raise GrammarRejectedError(f"token {token_id} breaks the request's grammar")
            n += 1
        self.num_accepted = n

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()
