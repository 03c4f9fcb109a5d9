"""Cheap checks of a checkpoint folder, made before torch is imported or a weight is read.

A wrong `--model`, a Hub id, a broken config.json or a folder without a tokenizer is then
reported in milliseconds, not after the seconds that building an engine takes. Imports
nothing heavy, so `conveyor serve` can call it before it loads anything.

A model is either an HF folder (config.json, safetensors, tokenizer files) or a llama.cpp
GGUF file, named directly or as the one *.gguf in a folder without config.json; a GGUF file
holds its tokenizer and chat template too.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

# AutoTokenizer builds a fast tokenizer from any one of these.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# `org/name`, as models are named on the Hugging Face Hub.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# llama.cpp's split files: model-00001-of-00003.gguf.
_GGUF_SPLIT = re.compile(r".*-\d{5}-of-\d{5}\.gguf", re.IGNORECASE)
_GGUF_MAGIC = b"GGUF"


def find_gguf_file(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file `path` names: itself if it is a *.gguf file, the one *.gguf file of a
    folder that has no config.json; None otherwise.

    Raises:
        ValueError: a folder with several *.gguf files (which one is ambiguous), a file that
            is not GGUF, or a split GGUF file (not supported).
    """
    p = Path(path)
    if p.is_dir():
        if (p / "config.json").is_file():
            return None
        found = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
        if len(found) > 1:
            raise ValueError(
                f"{path} holds several GGUF files ({', '.join(f.name for f in found)}); pass "
                "the one to load, e.g. --model " + str(found[0]) + "."
            )
        if not found:
            return None
        p = found[0]
    elif not (p.is_file() and p.suffix.lower() == ".gguf"):
        return None
    if _GGUF_SPLIT.fullmatch(p.name):
        raise ValueError(
            f"{p} is one part of a split GGUF file, which conveyor does not load; merge the "
            "parts with llama.cpp's `llama-gguf-split --merge` first."
        )
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ValueError(f"cannot read {p}: {exc}.") from None
    if magic != _GGUF_MAGIC:
        raise ValueError(f"{p} is not a GGUF file (it does not start with b'GGUF').")
    return p


def read_config_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed config.json of a checkpoint folder.

    Raises:
        ValueError: no config.json, or one that is not a valid JSON object (the message
            names the file, and the line and column of a syntax error).
    """
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} is not a checkpoint folder: it has no config.json.")
    try:
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{config_file} is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})."
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {config_file}: {exc}.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{config_file} must hold a JSON object, not {type(data).__name__}.")
    return data


def check_model_dir(model: str | os.PathLike[str]) -> None:
    """Raise ValueError unless `model` is a local folder with a readable config.json.

    A missing path shaped like a Hub id (`Qwen/Qwen2.5-0.5B-Instruct`) gets instructions to
    download it, since conveyor never downloads.
    """
    path = Path(model)
    if not path.exists():
        name = str(model)
        if _HUB_ID.fullmatch(name):
            local = f"models/{name.split('/')[1]}"
            raise ValueError(
                f"model folder {name!r} not found, and conveyor loads local folders only (no "
                f"Hugging Face Hub downloads). Download it first, e.g. `huggingface-cli download "
                f"{name} --local-dir {local}`, then pass --model {local}."
            )
        where = "" if path.is_absolute() else f" (looked in {os.path.abspath(name)})"
        raise ValueError(
            f"model folder not found: {name!r}{where}; --model takes a local checkpoint folder "
            "with config.json, the *.safetensors weights and the tokenizer files, or a .gguf "
            "file."
        )
    if find_gguf_file(path) is not None:
        return
    if not path.is_dir():
        raise ValueError(
            f"--model must be a checkpoint folder or a .gguf file, but {str(model)!r} is "
            "another file."
        )
    read_config_json(path)


def check_tokenizer_dir(path: str | os.PathLike[str]) -> None:
    """Raise ValueError unless `path` is a folder with tokenizer files or a GGUF file (which
    holds its tokenizer)."""
    if find_gguf_file(path) is not None:
        return
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"tokenizer folder not found: {str(path)!r}.")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)}); pass "
            "--tokenizer DIR or copy the tokenizer files into it."
        )


def check_checkpoint(model: str | None, tokenizer: str | None = None) -> None:
    """The cheap checks of an engine's model and tokenizer folders (model None: the demo
    model, which conveyor builds itself)."""
    if model is not None:
        check_model_dir(model)
    folder = tokenizer if tokenizer is not None else model
    if folder is not None:
        check_tokenizer_dir(folder)
