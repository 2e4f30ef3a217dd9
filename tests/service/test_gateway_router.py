"""The gateway's reply bookkeeping (ReplyRouter, over the memory bus): exactly-once in-order delivery by
event index, the owner's death and the deadlines, heartbeat reads that tolerate blips and bad beats,
supervised background tasks, and no per-request state left on any end path."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient

from service import reply_router
from service.config import GatewayConfig
from service.memory_broker import MemoryBus, MemoryGatewayBroker
from service.messages import (CONTROL_INDEX, ChoiceDelta, EventKind, Heartbeat, ReplyBatch, ReplyEvent, RequestMsg,
                              encode, encode_batch)
from service.supervise import supervised
from tests.service.conftest import MODEL_NAME, engine_stats, gateway_client, until
from tests.service.fake_v5_worker import FakeV5Worker, MemoryTransport

CONFIG = GatewayConfig(engine_poll_s=0.02, resume_deadline_s=0.2, accept_deadline_s=0.3, gap_wait_s=0.2)


def beat(engine_id: str, incarnation: str = "1") -> bytes:
    return encode(Heartbeat(engine_id, incarnation, MODEL_NAME, 2048, engine_stats()))


def output(index: int, token: int = 65, engine: str = "e", finished: bool = False) -> ReplyEvent:
    return ReplyEvent(EventKind.OUTPUT, engine, "1", [ChoiceDelta(0, [token], None, "length" if finished else None)],
                      finished=finished, index=index)


def accepted(engine: str, incarnation: str = "1") -> ReplyEvent:
    return ReplyEvent(EventKind.ACCEPTED, engine, incarnation, index=CONTROL_INDEX)


def send(broker: MemoryGatewayBroker, *events: ReplyEvent, engine: str = "e", incarnation: str = "1") -> None:
    broker.receive(encode_batch(ReplyBatch(engine, incarnation, [("r1", e) for e in events])))


def drain(queue: asyncio.Queue[ReplyEvent]) -> list[ReplyEvent]:
    return [queue.get_nowait() for _ in range(queue.qsize())]


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The reply router's monotonic clock, moved by the test: a deadline passes when the test says so, however
    long the machine takes over the steps in between (the watcher, polling, reads this clock too)."""
    now = [1000.0]
    monkeypatch.setattr(reply_router, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


@pytest.fixture
async def broker() -> AsyncIterator[MemoryGatewayBroker]:
    bus = MemoryBus()
    bus.beats["e"] = (beat("e"), float("inf"))
    broker = MemoryGatewayBroker(bus, CONFIG)
    await broker.start()
    try:
        yield broker
    finally:
        await broker.close()


async def submit(broker: MemoryGatewayBroker) -> asyncio.Queue[ReplyEvent]:
    return await broker.submit(RequestMsg("r1", [1], {}, broker.gateway_id, time.time(), MODEL_NAME))


async def test_duplicates_are_dropped_and_a_gap_that_stays_ends_the_request(broker, clock) -> None:
    queue = await submit(broker)
    send(broker, accepted("e"), output(0), output(0), output(1))
    send(broker, output(1), output(3))  # a retried publish, then index 2 is missing
    events = drain(queue)
    assert [(e.kind, e.index) for e in events] == [(EventKind.ACCEPTED, CONTROL_INDEX), (EventKind.OUTPUT, 0),
                                                   (EventKind.OUTPUT, 1)]
    clock[0] += CONFIG.gap_wait_s / 2
    broker._check_deadlines(clock[0])
    assert queue.empty() and broker.num_subscriptions == 1  # still waiting for index 2
    clock[0] += CONFIG.gap_wait_s
    broker._check_deadlines(clock[0])
    error = queue.get_nowait()
    assert error.kind is EventKind.ERROR and "lost reply events 2..2" in error.error
    assert broker.num_subscriptions == 0


async def test_events_past_a_gap_wait_for_it_and_follow_in_order(broker, clock) -> None:
    """An engine re-sending what a restarted Redis lost unread: the gap fills, nothing repeats."""
    queue = await submit(broker)
    send(broker, accepted("e"), output(0), output(3), output(2, token=66))
    assert [e.index for e in drain(queue)] == [CONTROL_INDEX, 0]
    send(broker, output(0), output(1), output(2), output(4, finished=True))  # the resend, then the next one
    events = drain(queue)
    assert [(e.index, e.choices[0].token_ids) for e in events] == [(1, [65]), (2, [66]), (3, [65]), (4, [65])]
    assert events[-1].finished and broker.num_subscriptions == 0
    clock[0] += CONFIG.gap_wait_s * 2
    broker._check_deadlines(clock[0])
    assert queue.empty()  # no late error: the gap closed


async def test_a_dead_owner_waits_for_a_resumer_then_fails_with_503(broker, clock) -> None:
    queue = await submit(broker)
    send(broker, accepted("e"), output(0))
    broker.bus.beats["e2"] = (beat("e2"), float("inf"))
    del broker.bus.beats["e"]  # the owner dies; e2 resumes the request in time
    await lost_from_now(broker, clock)
    clock[0] += CONFIG.resume_deadline_s / 2
    send(broker, accepted("e2"), output(1, engine="e2"), engine="e2")
    clock[0] += CONFIG.resume_deadline_s * 2
    broker._check_deadlines(clock[0])
    assert [e.index for e in drain(queue) if e.kind is EventKind.OUTPUT] == [0, 1] and broker.num_subscriptions == 1
    del broker.bus.beats["e2"]  # now nobody resumes it
    await lost_from_now(broker, clock)
    clock[0] += CONFIG.resume_deadline_s / 2
    broker._check_deadlines(clock[0])
    assert broker.num_subscriptions == 1  # within the resume deadline
    clock[0] += CONFIG.resume_deadline_s
    broker._check_deadlines(clock[0])
    assert broker.num_subscriptions == 0
    last = drain(queue)[-1]
    assert last.kind is EventKind.ERROR and last.status == 503 and "no engine resumed" in last.error


async def lost_from_now(broker: MemoryGatewayBroker, clock: list[float]) -> None:
    """The engines read again, and the deadlines checked: a request whose owner is gone is lost from now."""
    await broker._refresh_engines()
    broker._check_deadlines(clock[0])


async def test_a_request_no_engine_takes_fails_after_the_accept_deadline(broker) -> None:
    queue = await submit(broker)
    await until(lambda: broker.num_subscriptions == 0)
    error = drain(queue)[-1]
    assert error.status == 503 and "no engine took the request" in error.error


async def test_engines_are_gone_only_after_n_failed_reads_and_a_bad_beat_hides_one_engine(monkeypatch) -> None:
    bus = MemoryBus()
    bus.beats |= {"good": (beat("good"), float("inf")), "bad": (b"\x93junk", float("inf"))}
    broker = MemoryGatewayBroker(bus, GatewayConfig(engine_read_failures=3))
    await broker._refresh_engines()
    assert set(broker.engines) == {"good"} and broker.reachable

    async def unreadable() -> None:
        return None

    monkeypatch.setattr(broker, "_read_beats", unreadable)
    for _ in range(2):
        await broker._refresh_engines()
    assert set(broker.engines) == {"good"} and broker.reachable  # two blips: still there
    await broker._refresh_engines()
    assert broker.engines == {} and not broker.reachable


async def test_a_supervised_task_is_restarted_after_an_exception() -> None:
    runs = []

    async def flaky() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("bug")

    await asyncio.wait_for(supervised("flaky", flaky, 0.01), 2)
    assert len(runs) == 3


# ---- no state left, every end publishes the abort ---------------------------
BODY = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 400, "stream": True}


async def test_every_end_path_leaves_nothing_and_publishes_the_abort(tokenizer) -> None:
    bus = MemoryBus()
    config = GatewayConfig(engine_poll_s=0.02, accept_deadline_s=0.3, gap_wait_s=0.1)
    async with gateway_client(config, tokenizer, bus) as client:
        worker = FakeV5Worker(MemoryTransport(bus), step_s=0.01)
        task = asyncio.create_task(worker.run())
        try:
            while (await client.get("/ready")).status != 200:
                await asyncio.sleep(0.02)
            broker = next(iter(bus.gateways.values()))
            await _disconnect(client, bus, broker)
            await _gap(client, bus, broker, worker)
        finally:
            task.cancel()
        await _accept_deadline(client, bus, broker)


async def _disconnect(client: TestClient, bus: MemoryBus, broker: MemoryGatewayBroker) -> None:
    response = await client.post("/v1/completions", json=BODY)
    assert response.status == 200
    await response.content.readuntil(b"\n\n")
    response.close()
    await until(lambda: len(bus.aborts) == 1 and broker.num_subscriptions == 0)


async def _gap(client: TestClient, bus: MemoryBus, broker: MemoryGatewayBroker, worker: FakeV5Worker) -> None:
    response = await client.post("/v1/completions", json=BODY)
    assert response.status == 200
    await response.content.readuntil(b"\n\n")
    for run in worker.running.values():
        run.sent += 5  # the worker skips indices: the gateway must not emit text with a hole
    raw = (await response.read()).decode()
    assert '"code":"engine_error"' in raw and "lost" not in raw and raw.endswith("data: [DONE]\n\n")
    await until(lambda: len(bus.aborts) == 2 and broker.num_subscriptions == 0)


async def _accept_deadline(client: TestClient, bus: MemoryBus, broker: MemoryGatewayBroker) -> None:
    bus.beats["idle"] = (beat("idle"), float("inf"))  # alive, but it never takes anything
    response = await client.post("/v1/completions", json={**BODY, "stream": False})
    assert response.status == 503 and response.headers["Retry-After"] == "1"
    await until(lambda: len(bus.aborts) == 3 and broker.num_subscriptions == 0)
