"""A burst of 1,000 streaming requests sent at the same moment to one gateway (issue 11, point 5): each is
accepted or refused with 429, none gets a 503 (no client-side pool limit shows through), every accepted
one completes with the right text, and nothing per request is left behind. On the memory bus, and
against a real redis-server."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp.test_utils import TestClient, TestServer

from service.broker import connect
from service.config import GatewayConfig, RedisConfig
from service.gateway import Gateway
from service.gateway_app import build_app
from service.memory_broker import MemoryBus, MemoryGatewayBroker
from service.redis_gateway import RedisGatewayBroker
from tests.service.conftest import MODEL_NAME
from tests.service.fake_v5_worker import FakeV5Worker, MemoryTransport, RedisTransport, expected_text

BURST = 1_000
MAX_TOKENS = 8
BODY = {"model": MODEL_NAME, "prompt": "burst", "max_tokens": MAX_TOKENS, "stream": True}


@asynccontextmanager
async def serving(gateway: Gateway, worker: FakeV5Worker) -> AsyncIterator[TestClient]:
    task = asyncio.create_task(worker.run())
    try:
        # No client-side connection cap either: the burst reaches the gateway at once.
        async with TestClient(TestServer(build_app(gateway)), connector=aiohttp.TCPConnector(limit=0)) as client:
            while (await client.get("/ready")).status != 200:
                await asyncio.sleep(0.02)
            yield client
    finally:
        worker.stop()
        (ended,) = await asyncio.gather(task, return_exceptions=True)
        if isinstance(ended, Exception):  # then the streams' errors are its consequence: say why
            raise AssertionError(f"the fake worker failed: {ended!r}") from ended


async def one_stream(client: TestClient) -> tuple[int, str]:
    response = await client.post("/v1/completions", json=BODY)
    if response.status == 429:
        assert response.headers["Retry-After"] == "1"
    if response.status != 200:
        return response.status, await response.text()
    text = ""
    for block in (await response.read()).decode().strip().split("\n\n"):
        data = block[len("data: "):]
        if data == "[DONE]":
            continue
        event = json.loads(data)
        if "choices" not in event:  # an in-stream error ends it: the failure message shows the event
            return 200, data
        text += event["choices"][0]["text"]
    return 200, text


async def burst(client: TestClient, gateway: Gateway) -> list[int]:
    results = await asyncio.wait_for(asyncio.gather(*(one_stream(client) for _ in range(BURST))), 240)
    statuses = [status for status, _ in results]
    assert set(statuses) <= {200, 429}, [r for r in results if r[0] not in (200, 429)][:3]
    wrong = [text for status, text in results if status == 200 and text != expected_text(MAX_TOKENS, gateway.tokenizer)]
    assert not wrong, f"{len(wrong)} streams got other text or an error event, e.g. {wrong[:3]}"
    assert gateway.broker.num_subscriptions == 0  # no per-request state left
    return statuses


async def test_a_burst_on_the_memory_bus(tokenizer) -> None:
    bus = MemoryBus()
    config = GatewayConfig(engine_poll_s=0.05, max_pending_requests=BURST)
    gateway = Gateway(config, tokenizer, MODEL_NAME, 2048, MemoryGatewayBroker(bus, config))
    async with serving(gateway, FakeV5Worker(MemoryTransport(bus), step_s=0.005)) as client:
        assert (await burst(client, gateway)).count(200) == BURST  # max_pending_requests covers it


async def test_past_max_pending_requests_a_burst_gets_429_not_503(tokenizer) -> None:
    bus = MemoryBus()
    config = GatewayConfig(engine_poll_s=0.05, max_pending_requests=50)
    gateway = Gateway(config, tokenizer, MODEL_NAME, 2048, MemoryGatewayBroker(bus, config))
    async with serving(gateway, FakeV5Worker(MemoryTransport(bus), step_s=0.005)) as client:
        statuses = await burst(client, gateway)
    assert 200 in statuses and 429 in statuses


async def test_a_burst_against_redis(redis_url, tokenizer) -> None:
    # The gateway's pool is small on purpose: submissions share pipelines, they do not each need a connection.
    redis = RedisConfig(url=redis_url, prefix=f"t{uuid.uuid4().hex[:8]}", block_ms=100, max_connections=4)
    config = GatewayConfig(redis=redis, engine_poll_s=0.05, max_pending_requests=BURST)
    gateway = Gateway(config, tokenizer, MODEL_NAME, 2048, RedisGatewayBroker(config))
    worker_client = connect(redis)
    try:
        async with serving(gateway, FakeV5Worker(RedisTransport(worker_client, redis.prefix), step_s=0.005)) as client:
            assert (await burst(client, gateway)).count(200) == BURST
    finally:
        await worker_client.aclose()
