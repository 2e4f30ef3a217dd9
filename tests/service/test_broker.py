"""The Redis gateway broker against a real redis-server: shutdown never waits on a blocking read."""
from __future__ import annotations

import asyncio
import uuid

from service.broker import RedisGatewayBroker
from service.config import RedisConfig


async def test_close_wakes_the_blocked_reader_at_once(redis_url: str) -> None:
    # block_ms far above the deadline: close() must wake the reader's XREAD, not wait it out
    # (and not cancel it mid-read, which can leave the connection's teardown hanging).
    config = RedisConfig(url=redis_url, prefix=f"t{uuid.uuid4().hex[:8]}", block_ms=30_000)
    for _ in range(10):
        broker = RedisGatewayBroker(config)
        await broker.start()
        await asyncio.sleep(0.05)  # the reader is inside its blocking XREAD now
        await asyncio.wait_for(broker.close(), 2.0)
