"""The names a server answers to (the `model` field of requests and responses)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

DEMO_MODEL_NAME = "conveyor-demo"


def served_model_names(served: str | Sequence[str] | None, model: str | None) -> list[str]:
    """The names a server answers to: `served` (one or a list), else the checkpoint folder's
    last path component (a GGUF file's name without .gguf), else the demo's name."""
    if isinstance(served, str):
        return [served]
    if served:
        return list(dict.fromkeys(served))
    if model is None:
        return [DEMO_MODEL_NAME]
    # abspath, not resolve: "." and ".." name their folder, a symlink keeps its own name.
    name = Path(os.path.abspath(model)).name or str(model)
    # A GGUF file is named by its stem: "SmolLM2-135M-Instruct.Q4_1.gguf" -> "...Q4_1".
    return [name[: -len(".gguf")] if name.lower().endswith(".gguf") else name]
