"""Killing the worker mid-stream: its requests end with a clear error, never hang.

The gateway notices the dead engine when its heartbeat key expires and fails
the requests that engine owned (they are not replayed on another engine: their
tokens were already streamed, so a replay would duplicate output).
"""
from __future__ import annotations

import asyncio
import json
import signal

from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer

from service.config import GatewayConfig, RedisConfig
from service.gateway import Gateway
from tests.service.conftest import MODEL_NAME, WORKER_FLAGS, spawn, stop_process

LONG = {"model": MODEL_NAME, "prompt": "z" * 20, "max_tokens": 2000, "ignore_eos": True}


async def test_killed_worker_fails_its_requests(redis_url: str, demo_model: str) -> None:
    redis = RedisConfig(url=redis_url, prefix="death", block_ms=200)
    worker = spawn("worker", redis_url, "death", demo_model, *WORKER_FLAGS, "--engine-id", "doomed")
    gateway = Gateway(GatewayConfig(redis=redis, engine_poll_s=0.2), AutoTokenizer.from_pretrained(demo_model),
                      MODEL_NAME, 2048)
    try:
        async with TestClient(TestServer(gateway.app())) as client:
            while (await client.get("/ready")).status != 200:
                assert worker.poll() is None, "worker exited during startup"
                await asyncio.sleep(0.2)
            stream = await client.post("/v1/completions", json={**LONG, "stream": True})
            plain = asyncio.create_task(client.post("/v1/completions", json=LONG))
            await stream.content.readuntil(b"\n\n")  # tokens are flowing
            worker.send_signal(signal.SIGKILL)
            rest = (await asyncio.wait_for(stream.read(), 30)).decode()
            events = [block.split("\n")[1][len("data: "):] for block in rest.strip().split("\n\n")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert "doomed" in error["message"] and "stopped responding" in error["message"]
            response = await asyncio.wait_for(plain, 30)
            assert response.status == 503  # owned by the dead engine, or still queued with none left
            assert (await response.json())["error"]["message"]
    finally:
        stop_process(worker)
