"""A GGUF file's tokenizer, built without importing torch.

transformers builds the tokenizer of a GGUF file (`PreTrainedTokenizerFast.from_pretrained(
..., gguf_file=...)`) with its own GGUF reader, which imports torch: 200 MB more memory in
the HTTP server process, which holds a tokenizer and never runs the model. Here the metadata
comes from conveyor's reader (model/loading/gguf_file.py, numpy only) in the shape transformers'
reader gives it (numbers as lists, a string array other than the vocabulary and the merges
as its length), and transformers' own converter builds the same tokenizer from it.

When transformers' converter is not where this version of it keeps it, the tokenizer is
built the usual way (torch and all); tests/test_gguf_tokenizer.py holds both to the same
tokens, special tokens and chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerFast

from conveyor.model.loading.gguf_file import GGUFFile

# The string arrays transformers' reader reads in full; it gives any other as its length.
_FULL_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer (with its chat template) that transformers builds for the GGUF file
    at `path`."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            _SPECIAL_TOKENS,
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:  # another transformers layout: its own (torch-importing) path
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    metadata = _tokenizer_metadata(path)
    grouped = {
        group: {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = tokenizer.get("tokenizer_type")
    if kind == "llama":  # an older file without the flag: llama.cpp adds BOS (as transformers)
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":  # its chat template writes <bos> itself (as transformers)
        config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer)
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
