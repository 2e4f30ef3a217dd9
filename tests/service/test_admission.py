"""Whatever fails once a request has taken its key's slot, leaving gives back everything it took: the slot
(a key limited to one request in flight gets its next 200), the reply subscription, and the engine's request.
A failure is injected at each step of admission and after it."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

import service.gateway
import service.streaming
from service.config import GatewayConfig
from service.gateway import Gateway
from service.gateway_app import build_app
from service.memory_broker import MemoryBus, MemoryGatewayBroker
from tests.service.conftest import MODEL_NAME, memory_worker, running, until
from tests.service.fake_engine import FakeEngine

KEY = "sk-one-at-a-time"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Injected(Exception):
    pass


def fail(*_: Any, **__: Any) -> Any:
    raise Injected("injected")


async def fail_async(*_: Any, **__: Any) -> Any:
    raise Injected("injected")


async def fail_stream(*_: Any, **__: Any) -> AsyncIterator[Any]:
    raise Injected("injected")
    yield  # an async generator, as the one it replaces


@asynccontextmanager
async def one_slot_gateway(tokenizer: Any) -> AsyncIterator[tuple[Gateway, TestClient, FakeEngine]]:
    config = GatewayConfig(engine_poll_s=0.05, api_keys=(KEY,), key_policies=(f"{KEY}:max_concurrent=1",))
    bus, engine = MemoryBus(), FakeEngine()
    gateway = Gateway(config, tokenizer, MODEL_NAME, 2048, MemoryGatewayBroker(bus, config))
    async with TestClient(TestServer(build_app(gateway))) as client, running(memory_worker(bus, engine)):
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.02)
        yield gateway, client, engine


# (step, what to patch, its replacement, streamed): every step from taking the slot to serving the last byte.
INJECTIONS: list[tuple[str, Callable[[Gateway], tuple[Any, str]], Any, bool]] = [
    *[(f"{step}, {'stream' if stream else 'whole'}", where, replacement, stream) for stream in (False, True)
      for step, where, replacement in (("records", lambda gw: (gw, "_request_records"), fail),
                                       ("submit", lambda gw: (gw.broker, "submit"), fail_async),
                                       ("run", lambda gw: (service.gateway, "Run"), fail))],
    ("serving the whole response", lambda gw: (service.streaming.Run, "complete"), fail_async, False),
    ("serving the stream", lambda gw: (service.streaming.Run, "chunks"), fail_stream, True),
]


@pytest.mark.parametrize("step, where, replacement, stream", INJECTIONS, ids=[i[0] for i in INJECTIONS])
async def test_a_failure_at_any_step_gives_back_what_was_taken(tokenizer, monkeypatch, step, where, replacement,
                                                              stream) -> None:
    body = {"model": MODEL_NAME, "prompt": [70, 71, 72], "max_tokens": 3, "stream": stream}
    async with one_slot_gateway(tokenizer) as (gateway, client, engine):
        with monkeypatch.context() as patch:
            patch.setattr(*where(gateway), replacement)
            for _ in range(2):  # more than the key's one slot: each failed request gave its slot back
                failed = await client.post("/v1/completions", json=body, headers=AUTH)
                assert failed.status in (200, 500)  # a stream's 200 may be out before the failure
                assert "internal server error" in await failed.text()
        await until(lambda: gateway.broker.num_subscriptions == 0 and not engine.has_unfinished_requests())
        for _ in range(2):
            fine = await client.post("/v1/completions", json=body, headers=AUTH)
            text = await fine.text()  # a stream holds its slot until its end
            assert fine.status == 200 and "error" not in text, text
        assert gateway.broker.num_subscriptions == 0
