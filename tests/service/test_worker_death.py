"""Killing every worker mid-stream: with no engine left to resume them, their requests end with a
clear error once the gateway's resume deadline passes, never hang; restarted workers (same engine
ids, new incarnations) serve again. (Resuming on a surviving engine: tests/service/test_faults.py.)
The test borrows the session's stack and leaves it whole again.
"""
from __future__ import annotations

import asyncio
import json
import re

from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer

from service.redis_gateway import RedisGatewayBroker
from service.config import GatewayConfig, RedisConfig
from service.gateway import Gateway
from service.gateway_app import build_app
from service.local_stack import LocalStack
from tests.service.conftest import MODEL_NAME, START_TIMEOUT_S, until

LOST = r"engine w[01] stopped responding and no engine resumed the request within 2 s"
LONG = {"model": MODEL_NAME, "prompt": "z" * 20, "max_tokens": 2000, "ignore_eos": True}


async def ready(client: TestClient, engines: int) -> bool:
    response = await client.get("/ready")
    return response.status == 200 and (await response.json())["engines"] == engines


async def wait_ready(client: TestClient, engines: int) -> None:
    async def poll() -> None:
        while not await ready(client, engines):
            await asyncio.sleep(0.2)

    await asyncio.wait_for(poll(), START_TIMEOUT_S)


async def test_killed_workers_fail_their_requests(stack: LocalStack, demo_model: str) -> None:
    config = GatewayConfig(redis=RedisConfig(url=stack.redis_url, block_ms=200), engine_poll_s=0.2,
                           resume_deadline_s=2.0)
    gateway = Gateway(config, AutoTokenizer.from_pretrained(demo_model), MODEL_NAME, 2048,
                      RedisGatewayBroker(config))
    try:
        async with TestClient(TestServer(build_app(gateway))) as client:
            await wait_ready(client, engines=2)
            stream = await client.post("/v1/completions", json={**LONG, "stream": True})
            plain = asyncio.create_task(client.post("/v1/completions", json=LONG))
            await stream.content.readuntil(b"\n\n")  # tokens are flowing
            await until(lambda: gateway.broker.num_pending == 0)  # both requests are owned by an engine
            for worker in stack.workers:
                stack.kill(worker)
            rest = (await asyncio.wait_for(stream.read(), 30)).decode()
            events = [block[len("data: "):] for block in rest.strip().split("\n\n")]
            assert events[-1] == "[DONE]"
            assert re.fullmatch(LOST, json.loads(events[-2])["error"]["message"])
            response = await asyncio.wait_for(plain, 30)
            assert response.status == 503
            assert re.fullmatch(LOST, (await response.json())["error"]["message"])

            for worker in stack.workers:
                stack.restart(worker)
            await wait_ready(client, engines=2)
            again = await client.post("/v1/completions", json={**LONG, "max_tokens": 2})
            assert again.status == 200 and (await again.json())["usage"]["completion_tokens"] == 2
    finally:
        for worker in stack.workers:
            if worker.returncode is not None:
                stack.restart(worker)
        stack.wait_ready(START_TIMEOUT_S)
