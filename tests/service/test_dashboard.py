"""The KV dashboard's server side: the page's files, the snapshot route (auth, engines, its JSON), and the
worker publishing snapshots only while asked, no more often than its cost allows. The browser side is
tests/service/test_dashboard_browser.py."""
from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import numpy as np
import pytest
from aiohttp.test_utils import TestClient

from engine.core.kv_snapshot import CACHED, USED, KVSnapshot, PoolSnapshot, SnapshotRequest
from engine.stats import EngineStats
from service import worker as worker_module
from service.config import GatewayConfig
from service.memory_broker import MemoryBus
from service.messages import SchemaError, decode_kv_snapshot, encode, kv_snapshot_msg
from service.worker import KV_SNAPSHOT_INTERVAL_S, KV_SNAPSHOT_SHARE
from tests.service.conftest import (API_KEY, MODEL_NAME, count_calls, engine_stats, gateway_client, get_json,
                                    memory_worker, running, until)
from tests.service.fake_engine import FakeEngine

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def array(text: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype)


@pytest.fixture
async def client_and_bus(tokenizer) -> AsyncIterator[tuple[TestClient, MemoryBus]]:
    bus = MemoryBus()
    config = GatewayConfig(engine_poll_s=0.05, api_keys=(API_KEY,))
    async with gateway_client(config, tokenizer, bus) as client:
        yield client, bus


async def ready(client: TestClient) -> None:
    """Until the gateway has read the engine's heartbeat."""
    while (await client.get("/ready")).status != 200:
        await asyncio.sleep(0.02)


async def snapshot_when(client: TestClient, condition, engine: str = "") -> dict:
    """Polls the route as the page does until the snapshot meets ``condition`` (failing after 10 s, not hanging)."""
    async def poll() -> dict:
        while True:
            response = await client.get("/v1/kv_snapshot", params={"engine": engine} if engine else {}, headers=AUTH)
            if response.status == 200:
                body = await response.json()
                if body["snapshot"] is not None and condition(body["snapshot"]):
                    return body
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(poll(), 10)


async def test_the_page_is_public_and_self_contained(client_and_bus) -> None:
    client, _ = client_and_bus
    page = await client.get("/dashboard")
    html = await page.text()
    assert page.status == 200 and page.content_type == "text/html"
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    assert "/dashboard/dashboard.js" in html and "/dashboard/dashboard.css" in html and "://" not in html
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        response = await client.get(f"/dashboard/{name}")
        assert response.status == 200 and response.content_type == kind and "://" not in await response.text()
    assert (await client.get("/dashboard/other.js")).status == 401  # not a page: behind the key, then 404


async def test_snapshot_route_needs_the_key_and_a_live_engine(client_and_bus) -> None:
    client, bus = client_and_bus
    assert (await client.get("/v1/kv_snapshot")).status == 401
    none = await client.get("/v1/kv_snapshot", headers=AUTH)
    assert none.status == 503 and (await none.json())["error"]["code"] == "service_unavailable"
    async with running(memory_worker(bus, FakeEngine())):
        await ready(client)
        unknown = await client.get("/v1/kv_snapshot", params={"engine": "nope"}, headers=AUTH)
        assert unknown.status == 404 and (await unknown.json())["error"]["param"] == "engine"
        first = await (await client.get("/v1/kv_snapshot", headers=AUTH)).json()
        assert first["engines"] == ["w0"] and first["engine"] == "w0"


def count_iterations(engine: FakeEngine) -> list[int]:
    """Counts the worker's idle iterations (the list's one item): each reads the engine's stats, then takes a
    KV snapshot if one is wanted and due, with no await in between."""
    iterations, stats = [0], engine.stats

    def counted() -> EngineStats:
        iterations[0] += 1
        return stats()

    engine.stats = counted
    return iterations


async def test_snapshots_only_while_asked(client_and_bus) -> None:
    client, bus = client_and_bus
    engine = FakeEngine()
    iterations, worker = count_iterations(engine), memory_worker(bus, engine)
    beats = count_calls(worker.broker, "heartbeat")
    async with running(worker):
        await until(lambda: beats[0] >= 3 and iterations[0] >= 10)  # several beats and idle iterations
        assert engine.num_snapshots == 0 and not bus.kv_snapshots  # nobody asked
        body = await snapshot_when(client, lambda s: True)
    assert engine.num_snapshots >= 1 and body["snapshot"]["engine_id"] == "w0"


async def test_snapshot_json_shows_the_engine_blocks(client_and_bus) -> None:
    client, bus = client_and_bus
    async with running(memory_worker(bus, FakeEngine(step_s=0.02))):
        await ready(client)
        streams = [asyncio.create_task(client.post("/v1/completions", headers=AUTH, json={
            "model": MODEL_NAME, "prompt": "hello", "max_tokens": 1000})) for _ in range(3)]  # 20 s each
        body = await snapshot_when(client, lambda s: len(s["requests"]) == 3)
        for stream in streams:
            stream.cancel()
    snap = body["snapshot"]
    state, owner, filled = (array(snap["device"][name], dtype)
                            for name, dtype in (("state", "<u1"), ("owner", "<u2"), ("filled", "<u2")))
    assert snap["device"]["num_blocks"] == 16 and snap["block_size"] == 4 and snap["cpu"]["num_blocks"] == 0
    assert state.tolist() == [USED] * 3 + [0] * 13 and owner[:3].tolist() == [0, 1, 2]
    assert not filled[3:].any()
    assert [array(r["blocks"], "<u4").tolist() for r in snap["requests"]] == [[0], [1], [2]]
    assert {r["state"] for r in snap["requests"]} == {"running"} and snap["stats"]["num_requests_running"] == 3


async def test_a_costly_snapshot_is_taken_less_often(client_and_bus, monkeypatch) -> None:
    """Taking one costs 20 ms of CPU here: at most KV_SNAPSHOT_SHARE of the time goes to them, one every 4 s or
    more, not one every KV_SNAPSHOT_INTERVAL_S. On the worker's clock, moved here a step at a time."""
    client, bus = client_and_bus
    now = [1000.0]
    monkeypatch.setattr(worker_module, "time", SimpleNamespace(monotonic=lambda: now[0], time=time.time,
                                                               thread_time=time.thread_time))
    engine = FakeEngine(snapshot_s=0.02)
    iterations = count_iterations(engine)
    assert 0.02 / KV_SNAPSHOT_SHARE > 3 * KV_SNAPSHOT_INTERVAL_S
    async with running(memory_worker(bus, engine)):
        await until(lambda: bus.beats)
        await snapshot_when(client, lambda s: True)
        for _ in range(6):  # 3 s of a dashboard polling, a snapshot due every KV_SNAPSHOT_INTERVAL_S
            now[0] += KV_SNAPSHOT_INTERVAL_S
            await client.get("/v1/kv_snapshot", headers=AUTH)
            seen = iterations[0]
            await until(lambda: iterations[0] > seen)  # an iteration with the clock moved: a chance to take one
        assert engine.num_snapshots == 1
        now[0] += 60.0
        await client.get("/v1/kv_snapshot", headers=AUTH)
        await until(lambda: engine.num_snapshots == 2)  # due again, and taken


async def test_a_failing_snapshot_costs_no_request(client_and_bus) -> None:
    client, bus = client_and_bus
    engine = FakeEngine()

    def broken() -> KVSnapshot:
        engine.num_snapshots += 1
        raise RuntimeError("no picture")

    engine.kv_snapshot = broken
    async with running(memory_worker(bus, engine)):
        await ready(client)
        asked = await client.get("/v1/kv_snapshot", headers=AUTH)
        assert asked.status == 200 and (await asked.json())["snapshot"] is None
        await until(lambda: engine.num_snapshots)
        done = await client.post("/v1/completions", headers=AUTH, json={"model": MODEL_NAME, "prompt": "hi",
                                                                        "max_tokens": 3})
        assert done.status == 200 and (await done.json())["usage"]["completion_tokens"] == 3


def test_wire_format_round_trip_and_checks() -> None:
    pool = PoolSnapshot.empty(5)
    pool.state[:] = [USED, USED, CACHED, 0, USED]
    pool.ref_count[:] = [2, 1, 0, 0, 1]
    pool.filled[:] = [16, 3, 16, 0, 7]
    pool.set_owners([[0, 1], [0, 4]])
    snap = KVSnapshot(time.time(), 16, pool, PoolSnapshot.empty(2), [SnapshotRequest("a", "running", 2, [0, 1]),
                                                                     SnapshotRequest("b", "running", 1, [0, 4], [4])],
                      engine_stats(num_blocks_used=3))
    msg = decode_kv_snapshot(encode(kv_snapshot_msg("w0", "m", snap, {"b": "tenant-b"})))
    assert np.frombuffer(msg.device["owner"], "<u2").tolist() == [0, 0, 0xFFFF, 0xFFFF, 1]
    assert np.frombuffer(msg.device["filled"], "<u2").tolist() == [16, 3, 16, 0, 7]
    assert msg.requests[1][:3] == ["b", "running", 1] and np.frombuffer(msg.requests[1][3], "<u4").tolist() == [0, 4]
    assert [r[4] for r in msg.requests] == ["", "tenant-b"]
    assert [np.frombuffer(r[5], "<u4").tolist() for r in msg.requests] == [[], [4]]  # blocks with image tokens
    assert msg.stats == snap.stats and len(msg.cpu["state"]) == 2
    broken = kv_snapshot_msg("w0", "m", snap, {})
    broken.device["owner"] = broken.device["owner"][:-2]  # one entry short
    with pytest.raises(SchemaError, match="one entry per block"):
        decode_kv_snapshot(encode(broken))


def test_snapshot_through_redis(stack) -> None:
    """Two engines on the real stack: each publishes its own once asked, read through Redis."""
    for engine in ("w0", "w1"):
        deadline = time.monotonic() + 30
        while True:
            status, body = get_json(f"{stack.url}/v1/kv_snapshot?engine={engine}")
            assert status == 200 and body["engines"] == ["w0", "w1"] and body["engine"] == engine
            if body["snapshot"] is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        snap = body["snapshot"]
        assert snap is not None, f"no snapshot from {engine} in 30 s"
        state = array(snap["device"]["state"], "<u1")
        assert snap["engine_id"] == engine and len(state) == snap["stats"]["num_blocks_total"]
        assert (state >= USED).sum() == snap["stats"]["num_blocks_used"]
        assert (state == CACHED).sum() == snap["stats"]["num_blocks_cached"]
    assert get_json(f"{stack.url}/v1/kv_snapshot", api_key=None)[0] == 401
