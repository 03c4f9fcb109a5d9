"""The server's off-loop pools: output-constraint checks have a pool of their own."""

from __future__ import annotations

import asyncio
import threading

from conveyor.server.offload import off_loop, schema_pool


def test_a_busy_schema_pool_never_delays_text_work() -> None:
    """Schema checks once shared the text pool with chat templates and tokenizing: twenty
    slow invalid schemas held a one-token chat request for 48.6 s."""
    release = threading.Event()

    async def run() -> None:
        checks = [asyncio.ensure_future(off_loop(release.wait, 60, pool=schema_pool()))
                  for _ in range(8)]  # fmt: skip
        try:
            text = await asyncio.wait_for(off_loop(str.upper, "template"), timeout=30)
            assert text == "TEMPLATE"
            assert not any(c.done() for c in checks)  # the checks still hold their pool
        finally:
            release.set()
        assert await asyncio.gather(*checks) == [True] * 8

    asyncio.run(run())
