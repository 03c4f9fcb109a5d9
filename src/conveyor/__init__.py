"""conveyor: continuous batching over a paged KV cache, with an OpenAI-compatible server.

The public names are imported lazily so that `conveyor.core` (pure Python) stays free of torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.omp_env import apply_omp_wait_default

# Before anything imports torch (libgomp reads its wait policy once, as it loads).
apply_omp_wait_default()

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

_LAZY = {
    "LLM": "conveyor.entrypoints.llm",
    "AsyncLLM": "conveyor.entrypoints.async_llm",
    "SamplingParams": "conveyor.sampling_params",
    "PoolingParams": "conveyor.pooling_params",
    "EmbeddingRequestOutput": "conveyor.engine.outputs",
    "RequestOutput": "conveyor.engine.outputs",
    "CompletionOutput": "conveyor.engine.outputs",
}

if TYPE_CHECKING:
    from conveyor.engine.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
    from conveyor.entrypoints.async_llm import AsyncLLM
    from conveyor.entrypoints.llm import LLM
    from conveyor.pooling_params import PoolingParams
    from conveyor.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
