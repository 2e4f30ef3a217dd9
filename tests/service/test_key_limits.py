"""Priorities and per-API-key limits: a request's priority plus its key's reaches the engine; a key's
concurrency and token-rate limits hold across gateways (two gateways on one bus, and two limiters on one real
redis-server), answering 429 with Retry-After, while another key is untouched; slots return at each end."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from redis.asyncio import Redis

from service import limits
from service.config import GatewayConfig
from service.limits import KeyPolicy, MemoryLimiter, RedisLimiter, parse_key_policies, parse_policy
from service.memory_broker import MemoryBus
from tests.service.conftest import MODEL_NAME, gateway_client, memory_worker, running, until
from tests.service.fake_engine import FakeEngine

KEYS = ("sk-batch", "sk-chat")
POLICIES = (f"{KEYS[0]}:priority=5;max_concurrent=2;tokens_per_min=200",)


def config(**overrides) -> GatewayConfig:
    return GatewayConfig(engine_poll_s=0.05, api_keys=KEYS, key_policies=POLICIES, **overrides)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def body(max_tokens: int, **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": [70, 71, 72, 73], "max_tokens": max_tokens, **extra}


async def ready(client) -> None:
    while (await client.get("/ready", headers=auth(KEYS[1]))).status != 200:
        await asyncio.sleep(0.02)


def test_policies_parse_and_malformed_ones_fail_without_quoting_the_key() -> None:
    assert parse_key_policies(POLICIES) == {KEYS[0]: KeyPolicy(5, 2, 200)}
    assert parse_policy("") == KeyPolicy() and not KeyPolicy(priority=3).limited
    for bad in ("sk-secret-key:max_concurrent=x", "sk-secret-key:speed=3", "sk-secret-key:tokens_per_min=-1",
                "sk-secret-key"):
        with pytest.raises(ValueError) as error:
            GatewayConfig(api_keys=KEYS, key_policies=(bad,))
        assert "sk-secret-key" not in str(error.value)


async def test_priority_of_request_and_key_reach_the_engine(tokenizer) -> None:
    bus, engine = MemoryBus(), FakeEngine()
    async with gateway_client(config(), tokenizer, bus) as client, running(memory_worker(bus, engine)):
        await asyncio.wait_for(ready(client), 5)
        for key, priority in ((KEYS[0], -2), (KEYS[1], 3), (KEYS[1], None)):
            extra = {} if priority is None else {"priority": priority}
            response = await client.post("/v1/completions", json=body(2, **extra), headers=auth(key))
            assert response.status == 200, await response.text()
        bad = await client.post("/v1/completions", json=body(2, priority=2**40), headers=auth(KEYS[1]))
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "priority"
    assert [engine.priorities[r] for r in engine.added] == [3, 3, 0]  # the batch key adds 5


async def test_limits_hold_across_gateways_and_free_at_each_end(tokenizer) -> None:
    bus, engine = MemoryBus(), FakeEngine(step_s=0.02)
    batch, chat = auth(KEYS[0]), auth(KEYS[1])
    async with gateway_client(config(), tokenizer, bus) as one, gateway_client(config(), tokenizer, bus) as two, \
            running(memory_worker(bus, engine)):
        await asyncio.wait_for(ready(one), 5)
        too_large = await one.post("/v1/completions", json=body(300), headers=batch)
        assert too_large.status == 429 and "200 a minute" in (await too_large.json())["error"]["message"]
        # Two long streams hold the key's two slots, one on each gateway: a third is refused on either.
        streams = [await gw.post("/v1/completions", json=body(40, stream=True), headers=batch) for gw in (one, two)]
        await until(lambda: len(engine.requests) == 2)
        refused = await two.post("/v1/completions", json=body(2), headers=batch)
        assert refused.status == 429 and refused.headers["Retry-After"] == "1"
        assert (await refused.json())["error"]["code"] == "rate_limit_exceeded"
        assert (await one.post("/v1/completions", json=body(2), headers=chat)).status == 200  # another key
        for stream in streams:
            await stream.read()
        # The streams' ends freed the slots; their 88 tokens left 112 of the minute's 200: 4 + 120 wait.
        ok = await one.post("/v1/completions", json=body(2), headers=batch)
        assert ok.status == 200, await ok.text()
        over = await one.post("/v1/completions", json=body(120), headers=batch)
        assert over.status == 429 and int(over.headers["Retry-After"]) >= 4


@pytest.fixture
async def redis_client(redis_url: str):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.mark.parametrize("kind", ["redis", "memory"])
async def test_limiters_share_one_state(kind, redis_client, redis_config, monkeypatch) -> None:
    """Two limiters (two gateways) on one Redis decide as one; the in-process one decides the same. On the
    limiters' clock, which stands still but where the test moves it: no token refills, no lease ends, unasked."""
    now = [1_700_000_000.0]
    monkeypatch.setattr(limits, "time", SimpleNamespace(time=lambda: now[0]))
    shared = MemoryLimiter(lease_s=600)  # the Redis keys' own expiry (real time) is as long: never reached here
    one, two = ((RedisLimiter(redis_client, redis_config.prefix, lease_s=600) for _ in range(2)) if kind == "redis"
                else (shared, shared))
    policy = KeyPolicy(max_concurrent=2, tokens_per_min=600)
    assert await one.acquire("t", "r1", 100, policy) == 0
    assert await two.acquire("t", "r2", 100, policy) == 0
    assert await one.acquire("t", "r3", 100, policy) == -1  # both slots held
    assert await two.acquire("other", "r3", 100, policy) == 0  # per tenant
    await two.release("t", "r1")
    wait = await one.acquire("t", "r3", 500, policy)  # a slot is free, but 400 tokens are left of 600
    assert wait == 10.0  # 100 tokens at 10 a second
    assert await one.acquire("t", "r3", 300, policy) == 0
    now[0] += 600  # the leases of a gateway that died holding them run out
    assert await two.acquire("t", "r4", 10, KeyPolicy(max_concurrent=1)) == 0
