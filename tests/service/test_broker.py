"""The Redis clients: redis-py never retries a command behind our back. The Redis gateway broker against a real
redis-server: shutdown never waits on a blocking read (bursts: tests/service/test_burst.py)."""
from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.exceptions import ConnectionError

from service.broker import connect
from service.config import GatewayConfig, RedisConfig
from service.redis_gateway import RedisGatewayBroker


@pytest.mark.parametrize("blocking", [False, True])
async def test_a_failed_command_is_not_retried(blocking: bool) -> None:
    """A server that drops every connection at once: the command fails after one connection, not after
    redis-py's default three retries (a retried XADD or pipeline whose first try landed runs twice)."""
    connections = 0

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.transport.abort()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = connect(RedisConfig(url=f"redis://127.0.0.1:{port}/0"), blocking=blocking)
    try:
        with pytest.raises(ConnectionError):
            await client.xadd("k", {"f": "v"})
        assert connections == 1
    finally:
        await client.aclose()
        server.close()


async def test_close_wakes_the_blocked_reader_at_once(redis_url: str) -> None:
    # block_ms far above the deadline: close() must wake the reader's XREAD, not wait it out
    # (and not cancel it mid-read, which can leave the connection's teardown hanging).
    config = RedisConfig(url=redis_url, prefix=f"t{uuid.uuid4().hex[:8]}", block_ms=30_000)
    for _ in range(10):
        broker = RedisGatewayBroker(GatewayConfig(redis=config))
        await broker.start()
        await asyncio.sleep(0.05)  # the reader is inside its blocking XREAD now
        await asyncio.wait_for(broker.close(), 2.0)
