"""The OpenAI-compatible HTTP server: `build_app(AsyncLLM)` for ASGI, `run_server` to serve.

Imported lazily (FastAPI, uvicorn) so that `import conveyor` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["ServerConfig", "build_app", "run_server"]

_LAZY = {
    "build_app": "conveyor.server.app",
    "run_server": "conveyor.server.launch",
    "ServerConfig": "conveyor.server.config",
}

if TYPE_CHECKING:
    from conveyor.server.app import build_app
    from conveyor.server.config import ServerConfig
    from conveyor.server.launch import run_server


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'conveyor.server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
