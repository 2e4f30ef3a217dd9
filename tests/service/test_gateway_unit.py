"""The gateway's request runner over the in-memory broker, no Redis: HTTP in, a
worker on the demo engine (or a fake one) behind, the response out."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from service.config import GatewayConfig
from service.memory_broker import MemoryBus, MemoryWorkerBroker
from service.messages import Heartbeat
from tests.service.conftest import MODEL_NAME, gateway_client, engine_stats, memory_worker, running, until
from tests.service.fake_engine import BOOM_ON_STEP, FakeEngine

GREEDY = {"model": MODEL_NAME, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
async def client_and_bus(tokenizer) -> AsyncIterator[tuple[TestClient, MemoryBus]]:
    bus = MemoryBus()
    async with gateway_client(GatewayConfig(engine_poll_s=0.05, resume_deadline_s=0.3), tokenizer, bus) as client:
        yield client, bus


async def ready(client: TestClient) -> None:
    while (await client.get("/ready")).status != 200:
        await asyncio.sleep(0.02)


async def sse_data(client: TestClient, body: dict[str, Any]) -> list[str]:
    response = await client.post("/v1/completions", json={**body, "stream": True})
    assert response.status == 200
    raw = (await response.read()).decode()
    return [block[len("data: "):] for block in raw.strip().split("\n\n") if block.startswith("data: ")]


async def test_completion_whole_and_streamed(client_and_bus, demo_engine) -> None:
    client, bus = client_and_bus
    async with running(memory_worker(bus, demo_engine)):
        await asyncio.wait_for(ready(client), 5)
        body = {**GREEDY, "prompt": "paged", "max_tokens": 6}
        whole = await (await client.post("/v1/completions", json=body)).json()
        events = await sse_data(client, body)
    assert whole["usage"]["completion_tokens"] == 6 and whole["choices"][0]["finish_reason"] == "length"
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == whole["choices"][0]["text"]


async def test_a_quiet_stream_sends_keep_alive_comments(tokenizer) -> None:
    """While no event flows (a slow step), ': keep-alive' comments keep proxies from cutting the stream; the
    events between them are whole, with OpenAI's framing."""
    bus = MemoryBus()
    config = GatewayConfig(engine_poll_s=0.05, sse_keepalive_s=0.05)
    async with gateway_client(config, tokenizer, bus) as client:
        async with running(memory_worker(bus, FakeEngine(step_s=0.3))):
            await asyncio.wait_for(ready(client), 5)
            response = await client.post("/v1/completions", json={**GREEDY, "prompt": "p", "max_tokens": 3,
                                                                   "stream": True})
            raw = (await response.read()).decode()
    blocks = raw.strip().split("\n\n")
    assert ": keep-alive" in blocks and blocks[-1] == "data: [DONE]"
    data = [b for b in blocks if b != ": keep-alive"]
    assert all(b.startswith("data: ") and "\n" not in b for b in data) and len(data) == 3 + 1  # 3 tokens, [DONE]


async def test_engine_error_reaches_the_client(client_and_bus) -> None:
    client, bus = client_and_bus
    async with running(memory_worker(bus, FakeEngine())):
        await asyncio.wait_for(ready(client), 5)
        plain = await client.post("/v1/completions", json={**GREEDY, "prompt": [BOOM_ON_STEP], "max_tokens": 3})
        events = await sse_data(client, {**GREEDY, "prompt": [BOOM_ON_STEP], "max_tokens": 3})
    # A server fault: the client gets a request id to quote, never the exception's text.
    message = (await plain.json())["error"]["message"]
    assert plain.status == 500 and "kaboom" not in message and "request id cmpl-" in message
    assert plain.headers["X-Request-Id"] in message
    assert events[-1] == "[DONE]" and '"error"' in events[-2] and "request id cmpl-" in events[-2]
    assert "kaboom" not in events[-2]
    assert all(g.num_subscriptions == 0 for g in bus.gateways.values())  # the error path leaves nothing


async def test_client_disconnect_aborts_and_frees_blocks(client_and_bus, demo_engine) -> None:
    client, bus = client_and_bus
    free, generated = demo_engine.stats().num_blocks_free, demo_engine.stats().generation_tokens_total
    async with running(memory_worker(bus, demo_engine)):
        await asyncio.wait_for(ready(client), 5)
        response = await client.post("/v1/completions", json={**GREEDY, "prompt": "x" * 40, "max_tokens": 600,
                                                               "stream": True})
        await response.content.readuntil(b"\n\n")
        response.close()  # the client hangs up mid-stream
        await until(lambda: bus.aborts and not demo_engine.has_unfinished_requests())
        assert demo_engine.stats().num_blocks_free == free
        assert demo_engine.stats().generation_tokens_total - generated < 600  # stopped early, not finished


async def test_request_fails_once_no_engine_beats(client_and_bus) -> None:
    client, bus = client_and_bus
    await MemoryWorkerBroker(bus, "silent", MODEL_NAME, heartbeat_ttl_s=0.2).heartbeat(Heartbeat("silent", "1", MODEL_NAME,
                                                                                        2048, engine_stats()))
    await asyncio.wait_for(ready(client), 5)  # alive, but it never pulls: the request stays queued
    response = await client.post("/v1/completions", json={**GREEDY, "prompt": "a", "max_tokens": 2})
    assert response.status == 503 and "no engine has been available" in (await response.json())["error"]["message"]
    assert len(bus.queued[MODEL_NAME]) == 1
