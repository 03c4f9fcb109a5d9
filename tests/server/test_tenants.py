"""The server's requests carry their client as the tenant (core/tenant_shares.py): two API
keys are two tenants, every request of one key one tenant."""

from __future__ import annotations

import asyncio

import httpx

from conveyor.core.scheduler import Scheduler
from conveyor.entrypoints.async_llm import AsyncLLM
from conveyor.server.app import build_app


def test_each_api_key_is_its_own_tenant_in_the_scheduler(demo_model_dir, monkeypatch):
    seen: list[tuple[str, str]] = []
    real_add = Scheduler.add_request

    def add(self, req):
        seen.append((req.request_id, req.tenant))
        return real_add(self, req)

    monkeypatch.setattr(Scheduler, "add_request", add)

    async def run() -> None:
        llm = AsyncLLM(str(demo_model_dir), num_kv_blocks=64, log_stats_interval_s=0)
        app = build_app(llm, api_key=["k1", "k2"])
        await llm.start()
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                for key, path, body in [
                    ("k1", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 2}),
                    ("k2", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                    ("k1", "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
                    ("k2", "/v1/embeddings", {"input": "hi"}),
                ]:  # fmt: skip
                    headers = {"Authorization": f"Bearer {key}"}
                    resp = await client.post(path, json=body, headers=headers)
                    assert resp.status_code == 200, resp.text
        finally:
            await llm.shutdown()

    asyncio.run(run())
    tenants = [t for _, t in seen]
    assert all(tenants) and "k1" not in tenants  # keys are hashed, never kept
    assert len(tenants) == 5  # n=2 is two sequences
    k1, k2 = set(tenants[:2] + tenants[3:4]), {tenants[2], tenants[4]}
    assert len(k1) == len(k2) == 1 and not k1 & k2
