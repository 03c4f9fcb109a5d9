"""Request bodies are checked before pydantic reads them (server/body_checks.py): a large one
is parsed off the event loop, and a chat body's message count is read from the parsed JSON."""

from __future__ import annotations

import asyncio
import threading

import httpx

from conveyor.entrypoints.async_llm import AsyncLLM
from conveyor.server import body_checks
from conveyor.server.app import build_app
from conveyor.server.config import ServerConfig


def test_a_large_body_is_parsed_off_the_event_loop_and_other_requests_are_served(
    demo_model_dir, monkeypatch
) -> None:
    parsing, release = threading.Event(), threading.Event()
    real_parse = body_checks.parse_body

    def held_parse(body: bytes):
        if len(body) > body_checks.OFFLOAD_BYTES:  # the large body: hold it mid-parse
            parsing.set()
            assert release.wait(60)
        return real_parse(body)

    monkeypatch.setattr(body_checks, "parse_body", held_parse)
    many = [{"role": "user", "content": ""}] * 65_000

    async def run() -> None:
        llm = AsyncLLM(str(demo_model_dir), num_kv_blocks=64, log_stats_interval_s=0)
        app = build_app(llm, config=ServerConfig(max_chat_messages=256))
        await llm.start()
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                big = asyncio.create_task(
                    client.post("/v1/chat/completions", json={"messages": many, "max_tokens": 1})
                )
                while not parsing.is_set():
                    assert not big.done(), big.result().text
                    await asyncio.sleep(0.01)
                # The loop is free while the large body parses: another chat is answered.
                small = await client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                )
                assert small.status_code == 200, small.text
                assert not big.done()
                release.set()
                resp = await big
                assert resp.status_code == 400
                error = resp.json()["error"]
                assert error["param"] == "messages"
                assert (
                    "65000 messages" in error["message"]
                    and "max_chat_messages: 256" in (error["message"])
                )
        finally:
            release.set()
            await llm.shutdown()

    asyncio.run(run())
