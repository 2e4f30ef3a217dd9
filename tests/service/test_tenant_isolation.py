"""The prefix cache is salted per API key: two keys never share (nor, through
``usage.prompt_tokens_details.cached_tokens``, learn about) each other's cached
blocks, while one key shares across its own requests. Demo engine behind the
in-memory broker, no Redis."""
from __future__ import annotations

import asyncio
import random

from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer

from service.config import GatewayConfig
from service.gateway import Gateway
from service.gateway_app import build_app
from service.memory_broker import MemoryBus, MemoryGatewayBroker
from tests.service.conftest import MODEL_NAME, memory_worker, running

KEYS = ("sk-tenant-a", "sk-tenant-b")


def gateway_client(bus: MemoryBus, tokenizer, secret: str | None) -> TestClient:
    config = GatewayConfig(engine_poll_s=0.05, api_keys=KEYS, prefix_cache_secret=secret)
    gateway = Gateway(config, tokenizer, MODEL_NAME, 2048, MemoryGatewayBroker(bus, config))
    return TestClient(TestServer(build_app(gateway)))


async def cached_tokens(client: TestClient, key: str, prompt: str, **extra) -> int:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, **extra}
    response = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status == 200, await response.text()
    return (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_api_keys_never_share_cached_prefixes(demo_model, demo_engine) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    prompt = "".join(random.Random().choices("abcdefghij", k=120))  # fresh: no earlier test cached it
    bus = MemoryBus()
    async with gateway_client(bus, tokenizer, "shared-secret") as one, \
            gateway_client(bus, tokenizer, "shared-secret") as two, \
            gateway_client(bus, tokenizer, "other-secret") as other, running(memory_worker(bus, demo_engine)):
        while (await one.get("/ready", headers={"Authorization": f"Bearer {KEYS[0]}"})).status != 200:
            await asyncio.sleep(0.02)
        a, b = KEYS
        assert await cached_tokens(one, a, prompt) == 0
        assert await cached_tokens(one, a, prompt) >= 96  # the key shares with itself...
        assert await cached_tokens(two, a, prompt) >= 96  # ...across replicas with the same secret
        assert await cached_tokens(one, b, prompt) == 0  # another key sees nothing of it
        assert await cached_tokens(one, b, prompt) >= 96  # and shares its own
        assert await cached_tokens(other, a, prompt) == 0  # another secret is another tenant space
        assert await cached_tokens(one, b, prompt, cache_salt="x") == 0  # the request's salt still applies
        assert await cached_tokens(one, a, prompt, cache_salt="x") == 0  # ...on top of the key's
