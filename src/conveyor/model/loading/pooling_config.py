"""How a checkpoint pools its embeddings, read from its files (plain Python, no torch).

sentence-transformers checkpoints (Qwen3-Embedding, gte-Qwen2, e5-mistral ...) say it in
`modules.json`, whose `sentence_transformers.models.Pooling` module's folder holds a
`config.json` with one `pooling_mode_*` flag set:

    modules.json:           [{"path": "", "type": "...Transformer"},
                             {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                             {"path": "2_Normalize", "type": "...Normalize"}]
    1_Pooling/config.json:  {"pooling_mode_lasttoken": true, "pooling_mode_mean_tokens": false}

Without them a decoder pools its last token (vLLM's default for decoder embedding models);
`EngineConfig.pooling_type` overrides both. Matryoshka (`dimensions`): config.json's
`matryoshka_dimensions` (the sizes allowed) or `is_matryoshka: true` (any size up to the
hidden size), as vLLM reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_POOLING_MODULE = "sentence_transformers.models.Pooling"
# sentence-transformers' flags -> ours; the others (cls, max, weighted mean) are refused.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """The checkpoint's embedding settings (plain values: they cross the engine's pipe).

    pooling_type: "last" or "mean"; None when the checkpoint declares a pooling this engine
        does not compute (`unsupported` says which): its embedding requests are refused, its
        generation is not affected.
    source: where pooling_type came from ("sentence-transformers", "engine config", "default").
    hidden_size: the length of a full embedding.
    matryoshka: whether `dimensions` may shorten it; `dimensions_allowed`, when not None, the
        only sizes it may take.
    """

    pooling_type: str | None
    source: str
    hidden_size: int
    matryoshka: bool = False
    dimensions_allowed: tuple[int, ...] | None = None
    unsupported: str | None = None

    def check_request(self, dimensions: int | None) -> str:
        """The pooling an embedding request of this model gets; ValueError starting `pooling`
        (not supported) or `dimensions` (no vectors of that many values) otherwise."""
        if self.pooling_type is None:
            raise ValueError(f"pooling: {self.unsupported}")
        if dimensions is not None:
            self._check_dimensions(dimensions)
        return self.pooling_type

    def _check_dimensions(self, dimensions: int) -> None:
        if not self.matryoshka:
            if dimensions == self.hidden_size:
                return
            raise ValueError(
                f"dimensions is not supported by this model: it is not a Matryoshka model "
                f"(its embeddings have {self.hidden_size} dimensions, which cannot be "
                "shortened); leave dimensions out."
            )
        allowed = self.dimensions_allowed
        if allowed is not None and dimensions not in allowed:
            sizes = ", ".join(str(d) for d in allowed)
            raise ValueError(f"dimensions must be one of {sizes} for this model, got {dimensions}.")
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(
                f"dimensions must be in [1, {self.hidden_size}] for this model, got {dimensions}."
            )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from exc


def sentence_transformers_pooling(model_dir: Path) -> str | None:
    """The pooling a sentence-transformers checkpoint declares, or None when it has none.

    Raises:
        ValueError: an unreadable file, or a pooling mode this engine does not compute.
    """
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{str(modules_file)!r} must hold a list of modules.")
    for module in modules:
        if isinstance(module, dict) and module.get("type") == _POOLING_MODULE:
            config = _read_json(model_dir / str(module.get("path", "")) / "config.json")
            if not isinstance(config, dict):
                raise ValueError("the sentence-transformers Pooling config must be an object.")
            on = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
            if len(on) == 1 and on[0] in _MODES:
                return _MODES[on[0]]
            raise ValueError(
                f"the checkpoint's sentence-transformers pooling ({', '.join(on) or 'none'}) "
                "is not one this engine computes (pooling_mode_lasttoken or "
                "pooling_mode_mean_tokens); start the engine with pooling_type "
                "(--pooling-type) last or mean to override it."
            )
    return None


def read_pooling_config(
    model_path: str | Path, hidden_size: int, override: str | None = None
) -> PoolingConfig:
    """The checkpoint's embedding settings; `override` ("last" / "mean") wins when given.

    Args:
        model_path: the checkpoint folder (a GGUF file has no sentence-transformers config).
        hidden_size: the model's hidden size (the length of a full embedding).
    Never raises for the checkpoint's files: an unreadable or unsupported pooling config
    gives a PoolingConfig that refuses embedding requests, naming why.
    """
    model_dir = Path(model_path)
    hf: Any = {}
    if model_dir.is_dir() and (model_dir / "config.json").is_file():
        try:
            hf = _read_json(model_dir / "config.json")
        except ValueError:
            hf = {}
    hf = hf if isinstance(hf, dict) else {}
    sizes = hf.get("matryoshka_dimensions")
    allowed = None
    if isinstance(sizes, list) and sizes and all(type(d) is int for d in sizes):
        allowed = tuple(sizes)
    matryoshka = allowed is not None or hf.get("is_matryoshka") is True
    if override is not None:
        return PoolingConfig(override, "engine config", hidden_size, matryoshka, allowed)
    try:
        declared = sentence_transformers_pooling(model_dir) if model_dir.is_dir() else None
    except ValueError as exc:
        return PoolingConfig(None, "sentence-transformers", hidden_size, matryoshka, allowed,
                             unsupported=str(exc))  # fmt: skip
    if declared is not None:
        return PoolingConfig(declared, "sentence-transformers", hidden_size, matryoshka, allowed)
    return PoolingConfig("last", "default", hidden_size, matryoshka, allowed)
