"""The attention backends by name: each name's module and class, imported only when picked.

Plain Python at import (no torch): `EngineConfig` reads `available_backends()` through
`conveyor.config.settings.lazy_choices` to check `attention_backend` and to write its flag.
A new backend is its module (an `AttentionBackend` subclass declaring what it supports,
attention/metadata.py) and one line in `_BACKENDS`.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from conveyor.model.attention.metadata import AttentionBackend

logger = logging.getLogger(__name__)

# name -> (module, class)
_BACKENDS = {
    "torch": ("conveyor.model.attention.torch_attention", "TorchAttentionBackend"),
    "cpu": ("conveyor.model.attention.cpu_attention", "CpuAttentionBackend"),
    "triton": ("conveyor.model.attention.triton_attention", "TritonAttentionBackend"),
}


def available_backends() -> tuple[str, ...]:
    """The names `attention_backend` takes: "auto" and every registered backend."""
    return ("auto", *_BACKENDS)


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name` (its module imported now)."""
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Pick an attention backend by name.

    "auto": Triton on CUDA (the torch reference if triton cannot be imported), "cpu" on the
    CPU (C decode kernel; it falls back to the reference by itself where it cannot run), the
    torch reference elsewhere. "triton" forces the kernels (on CPU only under
    TRITON_INTERPRET=1); "torch" forces the reference.

    Raises:
        ValueError: an unknown name, or "triton" where the kernels cannot run.
    """
    import torch  # here, not at the top: the config reads the names without torch

    device = torch.device(device)
    if name == "auto":
        name = "cpu" if device.type == "cpu" else "torch"
        if device.type == "cuda":
            try:
                return backend_class("triton")(device)
            except ValueError as exc:
                logger.warning("Triton attention unavailable (%s); using torch.", exc)
    if name not in _BACKENDS:
        raise ValueError(
            f"Unknown attention backend {name!r}; choose one of {', '.join(available_backends())}."
        )
    return backend_class(name)(device)
