"""Text in and out: a thin tokenizer wrapper and an incremental detokenizer with stop strings.

The detokenizer turns one token at a time into text with tokenizers' `DecodeStream`, which
holds back tokens while their bytes end in an incomplete UTF-8 sequence, so a streamed delta
never carries a U+FFFD that a later token would have completed. Stop strings are searched
only in the tail that a new token could have completed, and `get_delta` keeps back the last
`len(longest stop) - 1` characters so a stop string is never streamed before it is matched.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from conveyor.engine.tokenizer_class import auto_tokenizer_class
from conveyor.model.loading.checkpoint import find_gguf_file
from conveyor.sampling_params import SamplingParams

# Prompt tokens decoded before the first output token, so the first output token's text
# (e.g. a leading space in SentencePiece vocabularies) is decoded in context.
_PROMPT_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A fast (Rust-backed) Hugging Face tokenizer with the few calls the engine needs."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> None:
        """Args:
        hf_tokenizer: a transformers fast tokenizer.
        eos_token_ids: extra end-of-sequence ids (e.g. from generation_config.json).
        """
        if getattr(hf_tokenizer, "backend_tokenizer", None) is None:
            raise ValueError("conveyor needs a fast tokenizer (one with a tokenizer.json).")
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer
        eos = hf_tokenizer.eos_token_id
        ids = ([eos] if eos is not None else []) + [i for i in eos_token_ids if i != eos]
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.vocab_size = len(hf_tokenizer)
        self._token_text: dict[int, str] = {}

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer of a local checkpoint directory.

        Args:
            path: directory with tokenizer.json (and optionally generation_config.json,
                whose eos_token_id, an int or a list, adds to `eos_token_ids`), or a GGUF
                file (or a folder holding one), whose metadata has the tokenizer.
        Returns:
            The wrapped tokenizer.
        """
        gguf_file = find_gguf_file(path)
        if gguf_file is not None:
            # transformers' converter builds the tokenizer and its chat template from the
            # file's metadata, read without torch (the server process never needs it).
            from conveyor.engine.gguf_tokenizer import gguf_tokenizer

            return cls(gguf_tokenizer(gguf_file))
        if not Path(path).is_dir():
            # Never fall through to a hub download: checkpoints are local directories.
            raise ValueError(f"tokenizer directory not found: {str(path)!r}")
        # The class AutoTokenizer would pick, without importing it: it imports torch, which
        # the server process never needs (engine/tokenizer_class.py). An absolute path, so
        # AutoTokenizer never matches it against its list of Hub names either.
        folder = Path(path).resolve()
        name = auto_tokenizer_class(folder)
        import transformers

        hf_class = getattr(transformers, name, None) if name is not None else None
        if hf_class is None:  # not a replayed case (or a transformers without that class)
            from transformers import AutoTokenizer as hf_class
        hf = hf_class.from_pretrained(str(folder))
        return cls(hf, _generation_eos_ids(folder))

    def with_generation_eos(self, params: SamplingParams) -> SamplingParams:
        """`params` plus the extra eos ids (generation_config.json) as stop token ids, so they
        stop the request like eos does (unless ignore_eos)."""
        eos = self.eos_token_id
        extra = [t for t in self.eos_token_ids if t != eos and t not in params.stop_token_ids]
        if params.ignore_eos or not extra:
            return params
        # A copy, not dataclasses.replace: the model's own ids do not count against the
        # request's MAX_STOP_TOKEN_IDS (and need no check).
        out = copy.copy(params)
        out.stop_token_ids = [*params.stop_token_ids, *extra]
        return out

    def with_bad_words(self, params: SamplingParams) -> SamplingParams:
        """`params` with `bad_words_token_ids` from its `bad_words`, as vLLM tokenizes them:
        each word (leading spaces stripped) as it is, and with one leading space when that
        gives a different first token and as many tokens (a word-initial spelling)."""
        if not params.bad_words:
            return params
        ids: list[list[int]] = list(params.bad_words_token_ids or ())
        for word in params.bad_words:
            plain = self.encode(word.lstrip(), add_special_tokens=False)
            if plain:
                ids.append(plain)
            spaced = self.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                ids.append(spaced)
        out = copy.copy(params)
        out.bad_words_token_ids = ids
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the tokenizer's BOS etc. when add_special_tokens)."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`, exactly as the detokenizer produces it for a whole sequence."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def chat_template_text(self) -> str | None:
        """The chat template's source (of all named ones together, if it has several)."""
        template = getattr(self.hf, "chat_template", None)
        if isinstance(template, dict):
            return "\n".join(t for t in template.values() if isinstance(t, str))
        return template if isinstance(template, str) else None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Render chat messages with the model's template and tokenize them.

        Args:
            messages: [{"role": ..., "content": ...}, ...], as `chat_messages` takes them.
            add_generation_prompt: end with the assistant turn's header.
            kwargs: extra variables for the template; `chat_template` replaces the
                tokenizer's own template.
        Returns:
            Prompt token ids.
        Raises:
            ValueError: no chat template, a malformed message (named), or the template
                raised an error.
        """
        if not self.has_chat_template and kwargs.get("chat_template") is None:
            raise ValueError(
                "This model's tokenizer has no chat template, so chat messages cannot be "
                "turned into a prompt; use the completions API with a plain prompt instead."
            )
        from jinja2 import TemplateError

        try:
            ids = self.hf.apply_chat_template(
                chat_messages(messages),
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                **kwargs,
            )
        except TemplateError as exc:  # e.g. the template's raise_exception("roles must ...")
            raise ValueError(f"The chat template refused these messages: {exc}") from exc
        return list(ids)

    def id_to_token_text(self, token_id: int) -> str:
        """Decoded text of a single token (e.g. " the"), as shown next to logprobs."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.backend.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as every chat template gets them: each a dict with a `role` and a
    `content` (a string, None or absent, or text parts, joined with newlines); other keys pass
    through; `developer` becomes `system`. ValueError names the first bad message and why."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(
            "messages must be a non-empty list of {'role': ..., 'content': ...} dicts; "
            f"got {messages!r:.80}."
        )
    return [_chat_message(m, i) for i, m in enumerate(messages)]


def _chat_message(message: Any, i: int) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(
            f"messages[{i}] must be a dict with 'role' and 'content'; "
            f"got {type(message).__name__} {message!r:.60}."
        )
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{i}] needs a 'role' string; got {role!r:.60}.")
    out = dict(message)
    # OpenAI's newer name for `system`. Most templates predate it and print an unknown role
    # verbatim or raise on it, so it is mapped for all of them rather than guessed per template.
    if role == "developer":
        out["role"] = "system"
    content = out.get("content")
    if isinstance(content, (list, tuple)):
        texts = []
        for k, part in enumerate(content):
            is_text = isinstance(part, Mapping) and part.get("type") == "text"
            if not (is_text and isinstance(part.get("text"), str)):
                raise ValueError(
                    f"messages[{i}].content[{k}] must be a {{'type': 'text', 'text': str}} "
                    f"part (only text is supported); got {part!r:.60}."
                )
            texts.append(part["text"])
        out["content"] = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ValueError(
            f"messages[{i}].content must be a string or a list of text parts; "
            f"got {type(content).__name__}."
        )
    return out


def _generation_eos_ids(path: Path) -> list[int]:
    config = path / "generation_config.json"
    if not config.is_file():
        return []
    eos = json.loads(config.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(i) for i in eos]


class IncrementalDetokenizer:
    """Output text of one request, grown token by token, with stop strings applied.

    Invariants: `output_text` never contains a matched stop string (unless
    include_stop_str_in_output) nor text after it; `emitted <= len(output_text)`, and
    the emitted text never contains the start of an unmatched stop string's occurrence.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Args:
        tokenizer: the request's tokenizer.
        prompt_token_ids: the prompt; its last tokens give the first output token context.
        params: skip_special_tokens, stop strings, include_stop_str_in_output, min_tokens.
        """
        self.tokenizer = tokenizer
        self.params = params
        self.stop_strings = list(params.stop_strings)
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1
        # A new match ends in the new text, so only stop strings whose last character is in
        # it can match: the per-token check looks at those alone (in the order given).
        self._stops_by_last_char: dict[str, list[tuple[int, str]]] = {}
        for order, stop in enumerate(self.stop_strings):
            self._stops_by_last_char.setdefault(stop[-1], []).append((order, stop))
        self._skip = params.skip_special_tokens
        self._ids: list[int] = []  # context tokens + every output token fed so far
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A prompt ending inside a UTF-8 sequence would make DecodeStream's prefix
        # inconsistent with its next decode; start without context then.
        if tokenizer.decode(context, self._skip).endswith(_REPLACEMENT_CHAR):
            context = []
        self._ids.extend(context)
        self._stream = DecodeStream(context, skip_special_tokens=self._skip)
        # Tokens [_group_start:_read) produced the last text chunk; [_read:) are pending.
        self._group_start = 0
        self._read = len(context)
        self._text = ""
        self._emitted = 0
        self._finished = False
        self.num_output_tokens = 0
        self.stop_string: str | None = None  # the stop string that ended the request

    @property
    def output_text(self) -> str:
        """Text so far, truncated at a matched stop string."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def update(self, new_token_ids: Iterable[int], stop_terminated: bool = False) -> str | None:
        """Add sampled tokens and look for stop strings.

        Args:
            new_token_ids: tokens sampled since the previous update.
            stop_terminated: the last token ended the request (eos or a stop_token_id); its
                text is left out unless include_stop_str_in_output, as vLLM does.
        Returns:
            The matched stop string (the request should finish), or None.
        """
        if self._finished or self.stop_string is not None:
            return None
        new = list(new_token_ids)
        self.num_output_tokens += len(new)
        if stop_terminated and new and not self.params.include_stop_str_in_output:
            new.pop()
        before = len(self._text)
        for token_id in new:
            chunk = self._step(token_id)
            if chunk:
                self._text += chunk
        if not self.stop_strings:  # (what _check_stop starts with, without the call)
            return None
        return self._check_stop(before)

    def flush(self) -> None:
        """Finish: decode the pending tokens even if they end in an incomplete UTF-8
        sequence (then the text ends in U+FFFD, as a full decode would). Idempotent."""
        if self._finished:
            return
        self._finished = True
        if self.stopped or self._read == len(self._ids):
            return
        group = self._ids[self._group_start : self._read]
        head = self.tokenizer.decode(group, self._skip)
        full = self.tokenizer.decode(group + self._ids[self._read :], self._skip)
        before = len(self._text)
        self._text += full[len(head) :] if full.startswith(head) else full
        self._read = len(self._ids)
        self._check_stop(before)

    def get_delta(self, finished: bool) -> str:
        """New text since the previous call that is safe to show.

        Args:
            finished: the request has ended; flush everything (never stop text).
        Returns:
            The delta; deltas concatenated equal the final output_text.
        """
        if finished:
            self.flush()
        end = len(self._text)
        if not (finished or self.stop_string is not None):
            end -= self._hold
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta

    def _step(self, token_id: int) -> str | None:
        self._ids.append(token_id)
        try:
            chunk = self._stream.step(self.tokenizer.backend, token_id)
        except Exception:
            return self._restart_stream()
        if chunk is not None:
            self._group_start, self._read = self._read, len(self._ids)
        return chunk

    def _restart_stream(self) -> str | None:
        """DecodeStream raises when a new token changes text it already returned (possible
        with some decoders); restart it on the last group that produced text and re-feed the
        pending tokens, so no text is lost or repeated."""
        base = self._read
        self._stream = DecodeStream(self._ids[self._group_start : base], self._skip)
        out: str | None = None
        for offset, token_id in enumerate(self._ids[base:], start=1):
            chunk = self._stream.step(self.tokenizer.backend, token_id)
            if chunk is not None:
                out = (out or "") + chunk
                self._group_start, self._read = self._read, base + offset
        return out

    def _check_stop(self, before: int) -> str | None:
        """Search stop strings in text that begins no earlier than a new match could."""
        if (
            not self.stop_strings
            or len(self._text) == before
            or self.num_output_tokens < self.params.min_tokens
        ):
            return None
        text = self._text
        by_last = self._stops_by_last_char
        candidates = {c for ch in set(text[before:]) for c in by_last.get(ch, ())}
        best = -1
        best_stop = ""
        # The earliest match wins; at one position, the stop string given first.
        for _, stop in sorted(candidates):
            idx = text.find(stop, max(0, before - len(stop) + 1))
            if idx != -1 and (best == -1 or idx < best):
                best, best_stop = idx, stop
        if best == -1:
            return None
        keep = best + len(best_stop) if self.params.include_stop_str_in_output else best
        self._text = text[:keep]
        self.stop_string = best_stop
        return best_stop
