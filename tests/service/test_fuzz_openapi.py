"""Schemathesis drives the gateway from its own /openapi.json, with valid and invalid
bodies: no 5xx ever, and every 4xx in OpenAI's error shape. A real HTTP gateway on the
in-memory broker with a fake engine behind it, no Redis. The default run draws 120 cases per
generation route (plus schemathesis' coverage cases), the slow run (-m slow) 1,000 per route."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web
from hypothesis import HealthCheck, settings
from transformers import AutoTokenizer

from service.config import GatewayConfig
from service.gateway import Gateway
from service.local_stack import free_port
from service.memory_broker import MemoryBus, MemoryGatewayBroker
from service.openapi import openapi_document
from tests.service.conftest import MODEL_NAME, memory_worker, running
from tests.service.fake_engine import FakeEngine

schemathesis = pytest.importorskip("schemathesis")

API_KEY = "sk-fuzz"
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck))
SCHEMA = schemathesis.openapi.from_dict(openapi_document(MODEL_NAME, GatewayConfig()))
CONTEXT = 64  # a short context keeps the fake engine's longest answer short


def serve(tokenizer, port: int, started: threading.Event, stop: asyncio.Event) -> None:
    async def main() -> None:
        bus = MemoryBus()
        config = GatewayConfig(engine_poll_s=0.05, api_keys=(API_KEY,))
        gateway = Gateway(config, tokenizer, MODEL_NAME, CONTEXT, MemoryGatewayBroker(bus, config))
        runner = web.AppRunner(gateway.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        # No fault hooks: a fuzzed prompt such as "1" starts with a hook's token, and the engine failures
        # it would inject (500, then the worker's exit after repeated failed steps) are not the API's.
        async with running(memory_worker(bus, FakeEngine(faults=False))):
            started.set()
            await stop.wait()
        await runner.cleanup()

    asyncio.run(main())


@pytest.fixture(scope="module")
def base_url(demo_model: str) -> Iterator[str]:
    port, started, stop = free_port(), threading.Event(), asyncio.Event()
    thread = threading.Thread(target=serve, args=(AutoTokenizer.from_pretrained(demo_model), port, started, stop),
                              daemon=True)
    thread.start()
    assert started.wait(30)
    yield f"http://127.0.0.1:{port}"
    stop._loop.call_soon_threadsafe(stop.set)  # the server's loop owns the event
    thread.join(10)


def check_call(case, base_url: str) -> None:
    response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert response.status_code < 500, (case.body, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text


@SCHEMA.include(method="POST").parametrize()
@settings(FUZZ, max_examples=120)
def test_generation_routes_never_5xx(case, base_url: str) -> None:
    check_call(case, base_url)


@pytest.mark.slow
@SCHEMA.include(method="POST").parametrize()
@settings(FUZZ, max_examples=1000)
def test_generation_routes_never_5xx_long_run(case, base_url: str) -> None:
    check_call(case, base_url)
