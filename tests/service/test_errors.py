"""Every error status, in OpenAI's error shape; 429/503 and a failing request
against an in-process gateway (and worker) on their own Redis prefix."""
from __future__ import annotations

import asyncio
import uuid

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer

from service.redis_worker import RedisWorkerBroker
from service.redis_gateway import RedisGatewayBroker
from service.config import GatewayConfig, RedisConfig, WorkerConfig
from service.gateway import Gateway
from service.gateway_app import build_app
from service.local_stack import LocalStack, free_port
from service.messages import EventKind, Heartbeat, ReplyEvent, event_row
from service.worker import Worker
from tests.service.conftest import API_KEY, MODEL_NAME, engine_stats, get_json
from tests.service.fake_engine import BOOM_ON_ADD, FakeEngine

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def assert_error(status: int, body: dict, expected: int, param: str | None = None) -> dict:
    assert status == expected, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


async def call(url: str, body: dict | bytes, headers: dict | None = AUTH) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        kwargs = {"data": body, "headers": {**(headers or {}), "Content-Type": "application/json"}} \
            if isinstance(body, bytes) else {"json": body, "headers": headers or {}}
        async with session.post(url, **kwargs) as response:
            return response.status, await response.json(content_type=None)


CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("change, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 17}, "n"),
    ({"max_tokens": "ten"}, "max_tokens"), ({"stop": ["a"] * 17}, "stop"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"), ({"stop_token_ids": [10**6]},
                                                                            "stop_token_ids"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"seed": -1}, "seed"),
    ({"logit_bias": {"1": 500}}, "logit_bias"), ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"response_format": {"type": "yaml"}}, "response_format"), ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"), ({"chat_template_kwargs": [1]},
                                                                       "chat_template_kwargs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_invalid_parameters_are_400(stack: LocalStack, change: dict, param: str) -> None:
    status, body = asyncio.run(call(f"{stack.url}/v1/chat/completions", {**CHAT, **change}))
    assert_error(status, body, 400, param)


def test_context_overflow_names_the_numbers(stack: LocalStack) -> None:
    status, body = asyncio.run(call(f"{stack.url}/v1/completions", {
        "model": MODEL_NAME, "prompt": "y" * 2000, "max_tokens": 100}))
    message = assert_error(status, body, 400)["message"]
    assert "2048" in message and "2000" in message and "100" in message and "2100" in message


def test_auth_model_size_and_json_errors(stack: LocalStack) -> None:
    url = f"{stack.url}/v1/chat/completions"
    assert_error(*asyncio.run(call(url, CHAT, headers=None)), 401)
    assert_error(*asyncio.run(call(url, CHAT, headers={"Authorization": "Bearer wrong"})), 401)
    assert_error(*asyncio.run(call(url, {**CHAT, "model": "gpt-4"})), 404, "model")
    huge = {**CHAT, "messages": [{"role": "user", "content": "z" * (1 << 20)}]}
    assert_error(*asyncio.run(call(url, huge)), 413)
    assert_error(*asyncio.run(call(url, b"{not json")), 400)
    assert_error(*asyncio.run(call(f"{stack.url}/v1/nothing", CHAT)), 404)
    assert_error(*get_json(f"{stack.url}/v1/models", api_key=None), 401)
    assert get_json(f"{stack.url}/ready", api_key=None)[0] == 200  # probes carry no key


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model: str):
    return AutoTokenizer.from_pretrained(demo_model)


def make_gateway(redis: RedisConfig, tokenizer, **overrides) -> Gateway:
    config = GatewayConfig(redis=redis, **{"engine_poll_s": 0.1, "resume_deadline_s": 1.0, **overrides})
    return Gateway(config, tokenizer, MODEL_NAME, 2048, RedisGatewayBroker(config))


async def fake_heartbeat(redis: RedisConfig) -> RedisWorkerBroker:
    broker = RedisWorkerBroker(redis, "fake-engine", MODEL_NAME, reply_ttl_s=60, heartbeat_ttl_s=30)
    await broker.start()
    await broker.heartbeat(Heartbeat("fake-engine", "1", MODEL_NAME, 2048, engine_stats()))
    return broker


async def test_queue_bound_is_429_and_disconnect_aborts(redis_url: str, prefix: str, demo_tokenizer) -> None:
    redis = RedisConfig(url=redis_url, prefix=prefix, block_ms=200)
    engine_side = await fake_heartbeat(redis)  # alive but never pulls: requests stay queued
    gateway = make_gateway(redis, demo_tokenizer, max_pending_requests=1, reconnect_grace_s=0)  # abort at once
    async with TestClient(TestServer(build_app(gateway))) as client:
        first = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a", "stream": True})
        assert first.status == 200
        second = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "b"})
        assert_error(second.status, await second.json(), 429)
        assert second.headers["Retry-After"] == "1"
        first.close()  # the client hangs up: the gateway must publish an abort
        aborts: list[str] = []
        while not aborts:
            aborts = (await engine_side.poll(0, block=False))[1]
            await asyncio.sleep(0.05)
        assert aborts[0].startswith("cmpl-")
    await engine_side.close()


async def test_restarted_engine_with_same_id_fails_old_requests(redis_url: str, prefix: str,
                                                                demo_tokenizer) -> None:
    redis = RedisConfig(url=redis_url, prefix=prefix, block_ms=200)
    engine_side = await fake_heartbeat(redis)
    gateway = make_gateway(redis, demo_tokenizer)
    async with TestClient(TestServer(build_app(gateway))) as client:
        pending = asyncio.create_task(client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a"}))
        pulled: list = []
        while not pulled:
            pulled = (await engine_side.poll(1, block=False))[0]
        accepted = ReplyEvent(EventKind.ACCEPTED, "fake-engine", "1")
        await engine_side.publish([(pulled[0].handle, event_row(pulled[0].handle.request_id, accepted))], [])
        # The same engine id beats again, from a new process: the old one's request cannot finish.
        await engine_side.heartbeat(Heartbeat("fake-engine", "2", MODEL_NAME, 2048, engine_stats()))
        response = await asyncio.wait_for(pending, 10)
        error = assert_error(response.status, await response.json(), 503)
        assert "fake-engine stopped responding and no engine resumed the request within 1 s" in error["message"]
    await engine_side.close()


async def test_no_engine_or_no_redis_is_503(redis_url: str, prefix: str, demo_tokenizer) -> None:
    dead_redis = RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0", prefix=prefix, block_ms=200)
    for redis in (RedisConfig(url=redis_url, prefix=prefix, block_ms=200), dead_redis):
        async with TestClient(TestServer(build_app(make_gateway(redis, demo_tokenizer)))) as client:
            ready = await client.get("/ready")
            assert ready.status == 503
            response = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a"})
            assert_error(response.status, await response.json(), 503)


async def test_cors_allows_only_configured_origins(redis_url: str, prefix: str, demo_tokenizer) -> None:
    gateway = make_gateway(RedisConfig(url=redis_url, prefix=prefix), demo_tokenizer,
                           cors_origins=("https://app.example",), api_keys=("k",))
    async with TestClient(TestServer(build_app(gateway))) as client:
        preflight = await client.options("/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert preflight.status == 204
        assert preflight.headers["Access-Control-Allow-Origin"] == "https://app.example"
        other = await client.get("/health", headers={"Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in other.headers
        denied = await client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert denied.status == 401 and denied.headers["Access-Control-Allow-Origin"] == "https://app.example"


async def test_failing_request_does_not_stop_the_worker(redis_url: str, prefix: str, demo_tokenizer) -> None:
    redis = RedisConfig(url=redis_url, prefix=prefix, block_ms=200)
    config = WorkerConfig(redis=redis, engine_id="fake", heartbeat_interval_s=0.1)
    broker = RedisWorkerBroker(redis, config.engine_id, MODEL_NAME, config.reply_ttl_s, config.heartbeat_ttl_s)
    worker = Worker(config, FakeEngine(), MODEL_NAME, broker)
    loop_task = asyncio.create_task(worker.run())
    gateway = make_gateway(redis, demo_tokenizer)
    async with TestClient(TestServer(build_app(gateway))) as client:
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.05)
        bad = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [BOOM_ON_ADD, 1]})
        assert_error(bad.status, await bad.json(), 500)
        good = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [1, 2], "max_tokens": 3})
        assert (await good.json())["choices"][0]["text"] == demo_tokenizer.decode([66, 67, 68])  # FakeEngine's
    worker.stop()
    await asyncio.wait_for(loop_task, 5)
