"""`conveyor serve` on a CUDA GPU, as the Dockerfile's cuda image runs it (device auto, the demo
model): the engine process starts on the GPU with its CUDA graphs, answers completions,
streamed chats and concurrent requests, reports metrics, and stops cleanly on SIGTERM.
Skipped without a GPU (benchmarks/gpu_check.sh runs it on one)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from tests.serve_process import start_server

pytestmark = [
    pytest.mark.slow,  # each test talks to a real `conveyor serve`
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_serve_answers_from_the_gpu(tmp_path):
    server = start_server(["--max-num-seqs", "16"], tmp_path)
    url = server.base_url
    try:
        body = {"model": "conveyor-demo", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1

        chat = {
            "model": "conveyor-demo",
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 12,
            "stream": True,
        }
        events = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat, timeout=60) as s:
            assert s.status_code == 200
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")

        def one(i: int) -> int:
            req = {**body, "prompt": f"Request {i}", "temperature": 0.8, "seed": i}
            return httpx.post(f"{url}/v1/completions", json=req, timeout=60).status_code

        with ThreadPoolExecutor(12) as pool:  # decode batches of several sizes: their graphs
            assert list(pool.map(one, range(24))) == [200] * 24
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
        log = server.log()
        assert "CUDA graphs:" in log, log[-3000:]
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]
