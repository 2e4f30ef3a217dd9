"""Client mistakes are 4xx in OpenAI's shape before anything reaches the engine; a server
fault is a 500 that carries a request id and no exception text; an error after a stream
started ends the stream. In-process gateway on the in-memory broker, no Redis."""
from __future__ import annotations

import asyncio
import copy
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer

from engine.field_specs import INT64_MAX
from engine.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from service import responses
from service.config import GatewayConfig
from service.gateway import Gateway
from service.gateway_app import build_app
from service.memory_broker import MemoryBus, MemoryGatewayBroker
from service.messages import RequestMsg
from service.protocol import MAX_CACHE_SALT_CHARS, MAX_JSON_DEPTH
from tests.service.conftest import MODEL_NAME, memory_worker, running, until
from tests.service.fake_engine import FakeEngine

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3}


@pytest.fixture(scope="module")
def tokenizer(demo_model: str):
    return AutoTokenizer.from_pretrained(demo_model)


def make_client(tokenizer, api_keys: tuple[str, ...] = ()) -> tuple[TestClient, MemoryBus, Gateway]:
    bus = MemoryBus()
    config = GatewayConfig(engine_poll_s=0.05, api_keys=api_keys)
    gateway = Gateway(config, tokenizer, MODEL_NAME, 2048, MemoryGatewayBroker(bus, config))
    return TestClient(TestServer(build_app(gateway))), bus, gateway


@pytest.fixture
async def served(tokenizer) -> AsyncIterator[tuple[TestClient, Gateway]]:
    client, bus, gateway = make_client(tokenizer)
    async with client, running(memory_worker(bus, FakeEngine())):
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.02)
        yield client, gateway


async def post(client: TestClient, path: str, body: dict | bytes) -> tuple[int, dict]:
    kwargs: dict[str, Any] = {"json": body} if isinstance(body, dict) else \
        {"data": body, "headers": {"Content-Type": "application/json"}}
    response = await client.post(path, **kwargs)
    return response.status, await response.json(content_type=None)


def assert_error(status: int, body: dict, expected: int, param: str | None = None) -> str:
    assert status == expected, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param, body
    return body["error"]["message"]


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "prompt": "a", "temperature": NaN}', b'{"model": "m", "prompt": "a", "top_p": Infinity}',
    b'{"model": "m", "prompt": "a", "temperature": -Infinity}', b'{"model": "m", "prompt": "a", "temperature": 1e999}',
    b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1),
    b'{"model": "m", "prompt": "a", "seed": 1' + b"0" * 5000 + b"}", b"\xff\xfe{",
])
async def test_malformed_json_is_400(served, raw: bytes) -> None:
    client, _ = served
    assert_error(*await post(client, "/v1/completions", raw), 400)


@pytest.mark.parametrize("change, param", [
    ({"top_k": 2**64}, "top_k"), ({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"),
    ({"max_tokens": 2**63}, "max_tokens"), ({"temperature": 10**400}, "temperature"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)}, "cache_salt"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0]"),
    # An image part to the (text-only) demo model: refused, naming the part.
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0]"),
])
async def test_out_of_range_values_are_400(served, change: dict, param: str) -> None:
    client, gateway = served
    assert_error(*await post(client, "/v1/chat/completions", {**CHAT, **change}), 400, param)
    assert gateway.broker.num_pending == 0


async def test_top_k_beyond_the_vocabulary_is_clamped(tokenizer, demo_engine) -> None:
    client, bus, _ = make_client(tokenizer)
    async with client, running(memory_worker(bus, demo_engine)):
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.02)
        status, body = await post(client, "/v1/completions", {**COMPLETION, "top_k": INT64_MAX,
                                                               "temperature": 1.0, "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4


def test_the_engine_rejects_non_finite_floats_and_int64_overflow() -> None:
    for bad in ({"temperature": float("nan")}, {"top_p": float("inf")}, {"top_k": 2**63},
                {"stop_token_ids": [-1]}, {"stop_token_ids": [True]}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(top_k=INT64_MAX, seed=INT64_MAX).top_k == INT64_MAX


async def test_chat_template_error_is_400(tokenizer) -> None:
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    client, _, _ = make_client(strict)
    async with client:
        message = assert_error(*await post(client, "/v1/chat/completions", CHAT), 400, "messages")
    assert "roles must alternate" in message


async def test_undecodable_authorization_header_is_401(tokenizer) -> None:
    client, _, _ = make_client(tokenizer, api_keys=("sk-test",))
    async with client:
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xed\r\n"
                     b"Connection: close\r\n\r\n")
        raw = await reader.read()
        writer.close()
    assert raw.startswith(b"HTTP/1.1 401") and b'"invalid_api_key"' in raw


async def test_server_fault_is_500_with_request_id_and_no_text(served, monkeypatch, caplog) -> None:
    client, gateway = served

    def broken(_):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(gateway.prompts, "encode", broken)
    with caplog.at_level(logging.ERROR, logger="service.server_errors"):
        response = await client.post("/v1/completions", json=COMPLETION)
        message = assert_error(response.status, await response.json(), 500)
    request_id = response.headers["X-Request-Id"]
    assert request_id in message and "secret" not in message
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback is in the log


async def test_error_after_the_stream_started_ends_it(served, monkeypatch) -> None:
    client, _ = served

    def broken(*_):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(responses, "completion_choice", broken)
    response = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    raw = (await response.read()).decode()
    events = [block[len("data: "):] for block in raw.strip().split("\n\n")]
    assert response.status == 200 and events[-1] == "[DONE]"
    assert '"error"' in events[-2] and "request id" in events[-2] and "secret" not in raw


async def test_tokenizing_never_blocks_the_event_loop(served, monkeypatch) -> None:
    """Tokenizing holds until /health has answered: only a loop that tokenizes elsewhere can answer it."""
    client, gateway = served
    tokenize = gateway.prompts.encode
    tokenizing, answered, released = threading.Event(), threading.Event(), []

    def held(req):  # a 1 MB prompt's worth of tokenizing, ended by the test
        tokenizing.set()
        released.append(answered.wait(10))  # False: /health waited for the tokenizer (the loop is blocked)
        return tokenize(req)

    monkeypatch.setattr(gateway.prompts, "encode", held)
    generation = asyncio.ensure_future(post(client, "/v1/completions", COMPLETION))
    await until(tokenizing.is_set)
    assert (await client.get("/health")).status == 200
    answered.set()
    assert (await generation)[0] == 200 and released == [True]


async def test_an_unencodable_message_leaves_nothing_pending() -> None:
    broker = MemoryGatewayBroker(MemoryBus(), GatewayConfig(engine_poll_s=0.05))
    with pytest.raises(OverflowError):
        await broker.submit(RequestMsg("r1", [1], {"top_k": 2**70}, "g", 0.0, "m"))
    assert broker.num_pending == 0
