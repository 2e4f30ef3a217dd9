"""The guarded listener (service/connections.py) on real sockets: a real gateway (memory broker, no
engine) on 127.0.0.1 behind GuardedAppRunner, its deadlines set small; slow clients are cut off within
them, the per-peer cap holds, and normal clients see nothing of it."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from service.config import GatewayConfig
from service.connections import GuardedAppRunner, peer_key
from service.gateway import Gateway
from service.gateway_app import build_app
from service.memory_broker import MemoryBus, MemoryGatewayBroker
from tests.service.conftest import MODEL_NAME, until

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
CAP = 4
SLACK_S = 4.0  # how much later than its deadline a cut may come on a loaded machine
SLOW_CLIENTS = 20
REQUEST = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


@asynccontextmanager
async def guarded_gateway(tokenizer, **limits: float) -> AsyncIterator[tuple[str, int, GuardedAppRunner]]:
    config = GatewayConfig(**{"header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S, **limits})
    gateway = Gateway(config, tokenizer, MODEL_NAME, 2048, MemoryGatewayBroker(MemoryBus(), config))
    runner = GuardedAppRunner(build_app(gateway), config, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield "127.0.0.1", site.port, runner
    finally:
        await runner.cleanup()


async def closed_after(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


async def trickle(writer: asyncio.StreamWriter, data: bytes, interval_s: float) -> None:
    """``data`` a byte at a time until the server closes the connection."""
    for byte in data:
        if writer.is_closing():
            return
        writer.write(bytes([byte]))
        try:
            await writer.drain()
        except ConnectionError:
            return
        await asyncio.sleep(interval_s)


async def slowloris(host: str, port: int, prefix: bytes = b"") -> tuple[float, bytes]:
    """Sends ``prefix`` (whole requests), then headers at 5 bytes a second; (seconds until the
    server closed the connection, what it sent after ``prefix``'s answers)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(prefix)
    answers = b"".join([await reader.readuntil(b'"ok"}') for _ in range(prefix.count(b"GET "))])
    start = time.monotonic()
    sending = asyncio.create_task(trickle(writer, REQUEST.replace(b"\r\n\r\n", b"\r\nX-Pad: " + b"a" * 200), 0.2))
    rest = await asyncio.wait_for(closed_after(reader), HEADER_TIMEOUT_S + SLACK_S + 30)
    sending.cancel()
    writer.close()
    assert answers.count(b"200 OK") == prefix.count(b"GET ")
    return time.monotonic() - start, rest


@pytest.mark.parametrize("prefix", [b"", REQUEST * 2], ids=["new-connection", "kept-alive"])
async def test_headers_trickled_in_are_cut_off_at_the_header_timeout(tokenizer, prefix: bytes) -> None:
    async with guarded_gateway(tokenizer) as (host, port, _):
        results = await asyncio.gather(*(slowloris(host, port, prefix) for _ in range(SLOW_CLIENTS)))
    seconds = sorted(s for s, _ in results)
    assert all(rest == b"" for _, rest in results)  # no request got through
    assert HEADER_TIMEOUT_S - 0.1 <= seconds[0] and seconds[-1] <= HEADER_TIMEOUT_S + SLACK_S, seconds


async def test_a_silent_connection_is_closed_at_the_header_timeout(tokenizer) -> None:
    async with guarded_gateway(tokenizer) as (host, port, _):
        reader, writer = await asyncio.open_connection(host, port)
        start = time.monotonic()
        assert await asyncio.wait_for(closed_after(reader), HEADER_TIMEOUT_S + SLACK_S) == b""
        assert time.monotonic() - start >= HEADER_TIMEOUT_S - 0.1
        writer.close()


async def test_a_trickled_body_gets_408_and_the_connection_closed(tokenizer) -> None:
    body = b'{"model": "pagedserve-demo", "prompt": "' + b"x" * 200 + b'"}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    async with guarded_gateway(tokenizer) as (host, port, _):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head)
        start = time.monotonic()
        sending = asyncio.create_task(trickle(writer, body, 0.2))
        answer = await asyncio.wait_for(closed_after(reader), BODY_TIMEOUT_S + SLACK_S)
        sending.cancel()
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"code": "request_timeout"' in answer, answer[:300]
    assert time.monotonic() - start >= BODY_TIMEOUT_S - 0.1


async def test_the_connection_past_the_per_peer_cap_is_refused_until_one_closes(tokenizer) -> None:
    async with guarded_gateway(tokenizer, header_timeout_s=60, max_loopback_connections=CAP) as (host, port, runner):
        held = [await asyncio.open_connection(host, port) for _ in range(CAP)]
        await until(lambda: sum(runner.guard.open_by_peer.values()) == CAP)
        reader, writer = await asyncio.open_connection(host, port)
        refused = await asyncio.wait_for(closed_after(reader), SLACK_S)
        assert refused.startswith(b"HTTP/1.1 429 ") and b"too_many_connections" in refused, refused
        writer.close()
        assert sum(runner.guard.open_by_peer.values()) == CAP
        held.pop()[1].close()
        await until(lambda: sum(runner.guard.open_by_peer.values()) == CAP - 1)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(REQUEST)
        assert (await reader.readuntil(b'"ok"}')).startswith(b"HTTP/1.1 200 OK")
        writer.close()
        for _, held_writer in held:
            held_writer.close()


async def test_normal_clients_are_unaffected(tokenizer) -> None:
    """Keep-alive reuse, bodies, and as many connections at once as the cap allows."""
    opened = []

    async def on_connection_opened(*_: object) -> None:
        opened.append(time.monotonic())

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_connection_opened)
    async with guarded_gateway(tokenizer, max_loopback_connections=CAP) as (host, port, runner):
        async with aiohttp.ClientSession(f"http://{host}:{port}", connector=aiohttp.TCPConnector(limit=CAP),
                                         trace_configs=[trace]) as session:
            async def tokenize() -> int:
                async with session.post("/tokenize", json={"prompt": "hello " * 100}) as response:
                    return response.status

            async def health() -> int:
                async with session.get("/health") as response:
                    return response.status

            for _ in range(3):  # rounds over the same kept-alive connections
                statuses = await asyncio.gather(*[tokenize() for _ in range(CAP)], *[health() for _ in range(CAP)])
                assert statuses == [200] * (2 * CAP)
            assert len(opened) <= CAP
            await asyncio.sleep(HEADER_TIMEOUT_S + 0.5)  # idle kept-alive connections outlive the header timeout
            before = len(opened)
            assert await health() == 200 and len(opened) == before  # on a kept-alive connection
        await until(lambda: not runner.guard.open_by_peer)


@pytest.mark.parametrize("address, key", [
    ("10.1.2.3", "10.1.2.3"), ("::ffff:10.1.2.3", "10.1.2.3"), ("2001:db8::5", "2001:db8::/64"),
    ("2001:db8::7%eth0", "2001:db8::/64"), ("::1", "::1"), (None, None)])
def test_peers_are_counted_by_address_and_ipv6_by_its_64(address: str | None, key: str | None) -> None:
    assert peer_key(address) == key
