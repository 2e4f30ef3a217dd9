"""SSE resume against a real redis-server: two in-process gateways and a fake v5 worker. A client that
drops its stream on gateway A and resumes on gateway B with ``Last-Event-ID`` gets exactly the rest."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp.test_utils import TestClient, TestServer

from service.broker import connect
from service.config import GatewayConfig, RedisConfig
from service.gateway import Gateway
from service.gateway_app import build_app
from service.openapi import openapi_document
from service.redis_gateway import RedisGatewayBroker
from tests.service.conftest import API_KEY, MODEL_NAME
from tests.service.fake_v5_worker import FakeV5Worker, RedisTransport, expected_text

OTHER_KEY = "other-key-456"
MAX_TOKENS = 40
BODY = {"model": MODEL_NAME, "prompt": "resume", "max_tokens": MAX_TOKENS, "stream": True}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS,
        "stream": True}


def headers(key: str = API_KEY, last: str | None = None) -> dict[str, str]:
    """A resuming client's: it asks for the events' ids (``X-Resumable``)."""
    return {"Authorization": f"Bearer {key}", "X-Resumable": "1"} | ({"Last-Event-ID": last} if last else {})


@asynccontextmanager
async def deployment(redis_url: str, tokenizer, step_s: float = 0.02,
                     grace_s: float = 10.0) -> AsyncIterator[tuple[TestClient, ...]]:
    redis = RedisConfig(url=redis_url, prefix=f"t{uuid.uuid4().hex[:8]}", block_ms=100)
    config = GatewayConfig(redis=redis, engine_poll_s=0.05, api_keys=(API_KEY, OTHER_KEY), reconnect_grace_s=grace_s)
    client = connect(redis)
    worker = FakeV5Worker(RedisTransport(client, redis.prefix), step_s=step_s)
    task = asyncio.create_task(worker.run())
    gateways = [Gateway(config, tokenizer, MODEL_NAME, 2048, RedisGatewayBroker(config)) for _ in range(2)]
    try:
        async with (TestClient(TestServer(build_app(gateways[0]))) as a,
                    TestClient(TestServer(build_app(gateways[1]))) as b):
            for http in (a, b):
                while (await http.get("/ready", headers=headers())).status != 200:
                    await asyncio.sleep(0.02)
            yield a, b, worker, gateways
    finally:
        worker.stop()
        await asyncio.gather(task, return_exceptions=True)  # a failed step ends it too
        await client.aclose()


def frames(raw: bytes) -> list[tuple[str, str]]:
    """(id, data) of each SSE event."""
    out = []
    for block in raw.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["id"], lines["data"]))
    return out


def text(events: list[tuple[str, str]], chat: bool = False) -> str:
    parts = []
    for _, data in events:
        if data == "[DONE]":
            continue
        choice = json.loads(data)["choices"][0]
        parts.append(choice["delta"].get("content") or "" if chat else choice["text"])
    return "".join(parts)


@pytest.mark.parametrize("route, body", [("/v1/completions", BODY), ("/v1/chat/completions", CHAT)])
async def test_resume_on_another_gateway_continues_the_text(redis_url, tokenizer, route, body) -> None:
    async with deployment(redis_url, tokenizer) as (a, b, worker, gateways):
        first = await a.post(route, json=body, headers=headers())
        got = [await first.content.readuntil(b"\n\n") for _ in range(5)]
        first.close()  # the client's connection drops mid-stream
        head = frames(b"".join(got))
        request_id, k = head[-1][0].rsplit(":", 1)
        assert [i for i, _ in head] == [f"{request_id}:{n}" for n in range(5)]
        await asyncio.sleep(0.1)
        rest = await b.get(f"/v1/streams/{request_id}", headers=headers(last=f"{request_id}:{k}"))
        assert rest.status == 200
        tail = frames(await rest.read())
        assert [i for i, _ in tail] == [f"{request_id}:{n}" for n in range(5, 5 + len(tail))]
        assert tail[-1][1] == "[DONE]"
        assert text(head + tail, chat="chat" in route) == expected_text(MAX_TOKENS, tokenizer)
        assert request_id not in worker.aborted
        assert all(g.broker.num_subscriptions == 0 for g in gateways)


async def test_resume_after_the_end_replays_and_a_post_with_last_event_id_resumes(redis_url, tokenizer) -> None:
    async with deployment(redis_url, tokenizer, step_s=0.005) as (a, b, _, _):
        whole = frames(await (await a.post("/v1/completions", json=BODY, headers=headers())).read())
        request_id = whole[0][0].rsplit(":", 1)[0]
        replay = frames(await (await b.get(f"/v1/streams/{request_id}", headers=headers())).read())
        tail = frames(await (await b.post("/v1/completions", json=BODY,
                                          headers=headers(last=f"{request_id}:9"))).read())
    assert replay == whole  # the same events, ids, chunk ids and ``created``
    assert tail == whole[10:]
    assert text(whole) == expected_text(MAX_TOKENS, tokenizer)


async def test_another_tenant_and_an_unknown_id_get_404(redis_url, tokenizer) -> None:
    async with deployment(redis_url, tokenizer, step_s=0.005) as (a, b, _, gateways):
        whole = frames(await (await a.post("/v1/completions", json=BODY, headers=headers())).read())
        request_id = whole[0][0].rsplit(":", 1)[0]
        stranger = await b.get(f"/v1/streams/{request_id}", headers=headers(OTHER_KEY))
        unknown = await b.get(f"/v1/streams/cmpl-{uuid.uuid4().hex}", headers=headers())
        bad = await b.get(f"/v1/streams/{request_id}", headers=headers(last="nonsense"))
        for response in (stranger, unknown):
            error = (await response.json())["error"]
            assert response.status == 404 and error["code"] == "stream_not_found"
            assert "retention window" in error["message"]
        assert bad.status == 400
        assert all(g.broker.num_subscriptions == 0 for g in gateways)  # the refused resumes left nothing


async def test_a_stream_nobody_resumes_is_aborted_after_the_grace(redis_url, tokenizer) -> None:
    async with deployment(redis_url, tokenizer, grace_s=0.3) as (a, b, worker, gateways):
        first = await a.post("/v1/completions", json={**BODY, "max_tokens": 400}, headers=headers())
        request_id = frames(await first.content.readuntil(b"\n\n"))[0][0].rsplit(":", 1)[0]
        first.close()
        for _ in range(100):
            if request_id in worker.aborted:
                break
            await asyncio.sleep(0.05)
        assert request_id in worker.aborted
        late = await b.get(f"/v1/streams/{request_id}", headers=headers())
        assert late.status == 404  # aborted: its record is gone, never a stream that does not move
        assert all(g.broker.num_subscriptions == 0 for g in gateways)


async def test_a_client_bouncing_between_gateways_gets_the_whole_text_once(redis_url, tokenizer) -> None:
    async with deployment(redis_url, tokenizer, step_s=0.01) as (a, b, worker, gateways):
        response = await a.post("/v1/chat/completions", json=CHAT, headers=headers())
        seen: list[tuple[str, str]] = []
        for http in (b, a, b):  # drop after a few events each time, resume on the other gateway
            seen += frames(b"".join([await response.content.readuntil(b"\n\n") for _ in range(3)]))
            response.close()
            response = await http.post("/v1/chat/completions", json=CHAT, headers=headers(last=seen[-1][0]))
            assert response.status == 200
        seen += frames(await response.read())
        request_id = seen[0][0].rsplit(":", 1)[0]
        assert [i for i, _ in seen] == [f"{request_id}:{n}" for n in range(len(seen))]
        assert text(seen, chat=True) == expected_text(MAX_TOKENS, tokenizer) and request_id not in worker.aborted
        assert all(g.broker.num_subscriptions == 0 and not g.broker._adopted for g in gateways)


def test_the_openapi_document_describes_resuming() -> None:
    paths = openapi_document(MODEL_NAME)["paths"]
    resume = paths["/v1/streams/{request_id}"]["get"]
    assert {p["name"] for p in resume["parameters"]} == {"request_id", "Last-Event-ID"}
    assert "stream_not_found" in resume["responses"]["404"]["description"]
    for route in ("/v1/chat/completions", "/v1/completions"):
        assert [p["name"] for p in paths[route]["post"]["parameters"]] == ["Last-Event-ID", "X-Resumable"]


async def test_a_second_resume_on_one_gateway_ends_the_first_with_an_error(redis_url, tokenizer) -> None:
    """Two connections of one key resume one stream on one gateway: the newer reads on, the older gets an
    error event and ends (it never hangs), and the request runs to its end (no abort)."""
    async with deployment(redis_url, tokenizer, step_s=0.02) as (a, b, worker, gateways):
        first = await a.post("/v1/completions", json=BODY, headers=headers())
        head = frames(await first.content.readuntil(b"\n\n"))
        request_id = head[0][0].rsplit(":", 1)[0]
        older = await b.get(f"/v1/streams/{request_id}", headers=headers(last=head[-1][0]))
        older_head = frames(await older.content.readuntil(b"\n\n"))
        newer = await b.get(f"/v1/streams/{request_id}", headers=headers(last=older_head[-1][0]))
        older_rest = frames(await asyncio.wait_for(older.read(), 5))
        error = json.loads(older_rest[-2][1])["error"]
        assert older_rest[-1][1] == "[DONE]" and error["code"] == "stream_taken_over"
        rest = frames(await newer.read())
        first.close()
        assert text(head + older_head + rest) == expected_text(MAX_TOKENS, tokenizer)
        assert request_id not in worker.aborted
        assert all(g.broker.num_subscriptions == 0 for g in gateways)
