"""Which transformers tokenizer class `AutoTokenizer` would load for a checkpoint folder,
decided from the folder's JSON files alone.

`from transformers import AutoTokenizer` imports torch (through its config classes): seconds
of start-up and 200+ MB in the HTTP server process, which never runs the model, and most of
what an engine process spends loading its tokenizer. The class matters: a model-specific
class (`LlamaTokenizer`, `Qwen2Tokenizer`, ...) rebuilds the pre-tokenizer its own way rather
than reading tokenizer.json's, so a different class can tokenize differently.

This module replays AutoTokenizer's choice (transformers 5) for the folders of the families
conveyor serves: a config.json whose `model_type` is in `_REGISTERED`, a tokenizer.json, a
tokenizer_config.json naming one of `_KNOWN_CLASSES` and no `auto_map` (remote code). Anything
else answers None, and the caller asks AutoTokenizer itself. tests/engine/test_tokenizer_class.py
holds every combination to AutoTokenizer's own answer, and `_REGISTERED` to transformers'
tables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# model_type -> the tokenizer class transformers registers for it (TOKENIZER_MAPPING_NAMES;
# None: none, the checkpoint's own class is loaded), and whether transformers lists the type
# as one whose Hub checkpoints name a wrong class (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS:
# the registered class wins). Mistral is left to AutoTokenizer: its registered class depends
# on whether mistral_common is installed.
_REGISTERED: dict[str, tuple[str | None, bool]] = {
    "llama": (None, False),
    "qwen2": ("Qwen2Tokenizer", True),
    "qwen3": ("Qwen2Tokenizer", False),
}
# The tokenizer_class values of the checkpoints these families ship ("Fast" dropped).
_KNOWN_CLASSES = frozenset(
    ["TokenizersBackend", "PreTrainedTokenizer", "LlamaTokenizer", "GPT2Tokenizer",
     "Qwen2Tokenizer"]
)  # fmt: skip
# Names whose class is the generic backend that reads tokenizer.json as it is.
_GENERIC = frozenset({"TokenizersBackend", "PreTrainedTokenizer"})


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _byte_level(tokenizer_json: Path) -> bool:
    return '"ByteLevel"' in tokenizer_json.read_text(encoding="utf-8")


def auto_tokenizer_class(folder: Path) -> str | None:
    """The transformers class name AutoTokenizer would load for `folder` (an attribute of the
    `transformers` module), or None when this folder is not one of the cases replayed here."""
    config = _read_json(folder / "config.json")
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    if config is None or tokenizer_config is None or "auto_map" in tokenizer_config:
        return None
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file() or config.get("model_type") not in _REGISTERED:
        return None
    hub = tokenizer_config.get("tokenizer_class") or config.get("tokenizer_class")
    if not isinstance(hub, str) or hub.removesuffix("Fast") not in _KNOWN_CLASSES:
        return None
    hub = hub.removesuffix("Fast")
    registered, hub_is_wrong = _REGISTERED[config["model_type"]]
    if hub == "LlamaTokenizer" and not hub_is_wrong:
        # A Llama-named class over a byte-level tokenizer.json (Llama 3 style): the backend.
        return "TokenizersBackend" if _byte_level(tokenizer_json) else hub
    chosen = hub
    if registered is not None and hub != registered and hub_is_wrong:
        chosen = registered
    return "TokenizersBackend" if chosen in _GENERIC else chosen
