"""conveyor: continuous batching over a paged KV cache, with an OpenAI-compatible server.

The public names are imported lazily so that `conveyor.core` (pure Python) stays free of torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

_LAZY = {
    "LLM": "conveyor.llm",
    "AsyncLLM": "conveyor.async_engine",
    "SamplingParams": "conveyor.sampling_params",
    "RequestOutput": "conveyor.outputs",
    "CompletionOutput": "conveyor.outputs",
}

if TYPE_CHECKING:
    from conveyor.async_engine import AsyncLLM
    from conveyor.llm import LLM
    from conveyor.outputs import CompletionOutput, RequestOutput
    from conveyor.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
