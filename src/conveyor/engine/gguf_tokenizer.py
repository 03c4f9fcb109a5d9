"""A GGUF file's tokenizer, built without importing torch.

transformers builds the tokenizer of a GGUF file (`PreTrainedTokenizerFast.from_pretrained(
..., gguf_file=...)`) with its own GGUF reader, which imports torch: hundreds of MB more in
the HTTP server process, which holds a tokenizer and never runs the model. Here the metadata
comes from conveyor's reader (model/loading/gguf_file.py, numpy only) in the shape transformers'
reader gives it (numbers as lists, a string array other than the vocabulary and the merges
as its length), and transformers' own converter builds the same tokenizer from it.

When transformers' converter is not where this version of it keeps it, the tokenizer is
built the usual way (torch and all); tests/test_gguf_tokenizer.py holds both to the same
tokens, special tokens and chat template.

The converter indexes the metadata blindly (a KeyError for a file without tokens, a panic of
the tokenizers library for a repeated or empty token), so the metadata it reads is checked
first (`_check_tokenizer_metadata`), and anything else it raises becomes one ValueError line
naming the file (tests/model/test_bad_model_files.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerFast

from conveyor.model.loading.gguf_file import GGUFFile

# The string arrays transformers' reader reads in full; it gives any other as its length.
_FULL_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
# tokenizer.ggml.model -> what it is built from besides the tokens (llama.cpp's needs too).
_NEEDS = {
    "gpt2": ("merges", "its 'gpt2' (byte-level BPE) tokenizer"),
    "llama": ("merges or scores", "its 'llama' (SentencePiece) tokenizer"),
    "gemma4": ("merges or scores", "its 'gemma4' (SentencePiece) tokenizer"),
    "t5": ("scores", "its 't5' (Unigram) tokenizer"),
}
# What this file uses of transformers' converter module.
_CONVERTER = ("_SPECIAL_TOKENS", "GGUF_TOKENIZER_MAPPING", "convert_gguf_tokenizer")
_SPECIAL_IDS = ("bos", "eos", "unknown", "seperator", "padding", "cls", "mask", "eot", "eom")


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer (with its chat template) that transformers builds for the GGUF file
    at `path`."""
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping
    except ImportError:
        mapping = None
    if not all(hasattr(mapping, name) for name in _CONVERTER):
        # another transformers layout: its own (torch-importing) path
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    metadata = _tokenizer_metadata(path)
    _check_tokenizer_metadata(path, metadata)
    try:
        return _build(metadata, mapping)
    except ValueError as exc:
        raise ValueError(f"GGUF file {path}: {_one_line(exc)}") from None
    except Exception as exc:  # the converter's KeyError, IndexError, a tokenizers panic
        raise ValueError(
            f"GGUF file {path}: its tokenizer cannot be built from its metadata "
            f"({type(exc).__name__}: {_one_line(exc)})."
        ) from None


def _build(metadata: dict[str, Any], mapping: Any) -> PreTrainedTokenizerFast:
    """transformers' GGUF tokenizer from the checked metadata (`mapping`: its converter's
    module)."""
    grouped = {
        group: {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = tokenizer.get("tokenizer_type")
    if kind == "llama":  # an older file without the flag: llama.cpp adds BOS (as transformers)
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":  # its chat template writes <bos> itself (as transformers)
        config["add_bos_token"] = False
    for name, key in mapping._SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = mapping.convert_gguf_tokenizer(metadata["general.architecture"], tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def _tokenizer_metadata(path: Path) -> dict[str, Any]:
    """The file's general.architecture and tokenizer.* values as transformers' reader has
    them."""
    out: dict[str, Any] = {}
    for key, value in GGUFFile(path).metadata.items():
        if key != "general.architecture" and not key.startswith("tokenizer."):
            continue
        if isinstance(value, np.ndarray):
            value = value.tolist()
        elif isinstance(value, list) and key not in _FULL_STRING_ARRAYS:
            value = len(value)
        out[key] = value
    return out


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _check_tokenizer_metadata(path: Path, metadata: dict[str, Any]) -> None:
    """Raise ValueError (one line) for metadata the converter cannot build a tokenizer from:
    no tokens, tokens that are not unique non-empty strings, no merges (or scores) where the
    tokenizer model needs them, merges that are not strings, special token ids out of range.
    """
    where = f"GGUF file {path}"
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(
            f"{where} has no tokenizer.ggml.tokens, so it has no tokenizer: pass --tokenizer "
            "with a folder of the model's tokenizer files."
        )
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{where}: tokenizer.ggml.tokens must be a non-empty array of strings.")
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            raise ValueError(f"{where}: tokenizer.ggml.tokens[{i}] is not a string.")
        if not token:
            raise ValueError(
                f"{where}: tokenizer.ggml.tokens[{i}] is an empty string; each token must have "
                "text."
            )
        first = seen.setdefault(token, i)
        if first != i:
            raise ValueError(
                f"{where}: tokenizer.ggml.tokens[{i}] repeats tokens[{first}] ({token!r:.40}); "
                "each token must be unique."
            )
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None and not (
        isinstance(merges, list) and all(isinstance(m, str) for m in merges)
    ):
        raise ValueError(f"{where}: tokenizer.ggml.merges must be an array of strings.")
    scores = metadata.get("tokenizer.ggml.scores")
    kind = metadata.get("tokenizer.ggml.model")
    needs, what = _NEEDS.get(kind, (None, None)) if isinstance(kind, str) else (None, None)
    have = {"merges": merges is not None, "scores": scores is not None}
    if needs is not None and not any(have[n] for n in needs.split(" or ")):
        missing = " nor ".join(f"tokenizer.ggml.{n}" for n in needs.split(" or "))
        has = "has neither" if " or " in needs else "has no"
        raise ValueError(f"{where}: {what} {has} {missing}; it cannot be built without them.")
    for name in _SPECIAL_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        value = metadata.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens)
        ):
            raise ValueError(
                f"{where}: {key} is {value!r:.40}; it must be a token id from 0 to "
                f"{len(tokens) - 1}."
            )
