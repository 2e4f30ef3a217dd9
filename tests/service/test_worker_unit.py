"""The worker over the in-memory broker, no Redis: pulling only with room, replies
in order, aborts (queued or running), and errors reaching the requester."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import pytest

from engine import LLMEngine, SamplingParams
from service.config import GatewayConfig
from service.memory_broker import MemoryBus, MemoryGatewayBroker
from service.messages import EventKind, ReplyEvent, RequestMsg, params_to_wire
from tests.service.conftest import MODEL_NAME, memory_worker, running, until
from tests.service.fake_engine import BOOM_ON_ADD, BOOM_ON_STEP, FakeEngine


@pytest.fixture
def bus() -> MemoryBus:
    return MemoryBus()


@pytest.fixture
async def gateway(bus: MemoryBus) -> AsyncIterator[MemoryGatewayBroker]:
    broker = MemoryGatewayBroker(bus, GatewayConfig(engine_poll_s=0.05))
    await broker.start()
    yield broker
    await broker.close()


async def submit(gateway: MemoryGatewayBroker, request_id: str, prompt: list[int], wire: dict | None = None,
                 **params) -> asyncio.Queue[ReplyEvent]:
    wire = wire or params_to_wire(SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **params}))
    return await gateway.submit(RequestMsg(request_id, prompt, wire, gateway.gateway_id, time.time(), MODEL_NAME))


async def until_finished(queue: asyncio.Queue[ReplyEvent]) -> list[ReplyEvent]:
    events = [await asyncio.wait_for(queue.get(), 5)]
    while not events[-1].finished:
        events.append(await asyncio.wait_for(queue.get(), 5))
    return events


def tokens(events: list[ReplyEvent]) -> list[int]:
    return [t for e in events for c in e.choices for t in c.token_ids]


def free_blocks(engine: LLMEngine) -> tuple[int, int]:
    stats = engine.stats()
    return stats.num_blocks_free, stats.num_blocks_total


async def test_request_flows_through_the_real_engine(bus, gateway, demo_engine) -> None:
    async with running(memory_worker(bus, demo_engine)):
        events = await until_finished(await submit(gateway, "r1", [1, 2, 3], max_tokens=5))
    assert events[0].kind is EventKind.ACCEPTED and events[0].engine_id == "w0"
    assert len(tokens(events)) == 5 and events[-1].choices[-1].finish_reason == "length"
    assert not bus.queued[MODEL_NAME] and not bus.unacked  # pulled, then acked once finished


async def test_replies_arrive_in_order_per_request(bus, gateway) -> None:
    async with running(memory_worker(bus, FakeEngine())):
        queues = [await submit(gateway, f"r{i}", [1], max_tokens=3 + i) for i in range(6)]
        results = [await until_finished(q) for q in queues]
    for i, events in enumerate(results):
        assert tokens(events) == list(range(66, 66 + 3 + i))


async def test_pulls_only_with_room(bus, gateway) -> None:
    engine = FakeEngine()
    async with running(memory_worker(bus, engine)):
        busy = await submit(gateway, "busy", [1], max_tokens=200)
        await asyncio.wait_for(busy.get(), 5)  # accepted
        engine.capacity = False
        queue = await submit(gateway, "r1", [1], max_tokens=2)
        await until(lambda: not engine.has_unfinished_requests())  # stepping "busy", it polled with no room
        assert len(bus.queued[MODEL_NAME]) == 1 and queue.empty() and gateway.num_pending == 1
        engine.capacity = True
        assert tokens(await until_finished(queue)) == [66, 67]


async def test_queued_then_aborted_request_never_starts(bus, gateway) -> None:
    engine = FakeEngine()
    queue = await submit(gateway, "r1", [1], max_tokens=2)
    await gateway.abort("r1")
    kept = await submit(gateway, "r2", [1], max_tokens=2)
    async with running(memory_worker(bus, engine)):
        assert tokens(await until_finished(kept)) == [66, 67]
    assert engine.added == ["r2"] and queue.empty()  # r1 was answered, but to nobody: the gateway let go
    assert not bus.unacked


async def test_abort_frees_the_blocks(bus, gateway, demo_engine) -> None:
    before, generated = free_blocks(demo_engine), demo_engine.stats().generation_tokens_total
    async with running(memory_worker(bus, demo_engine)):
        queue = await submit(gateway, "long", [5] * 40, max_tokens=600)  # fits in the KV cache
        while not tokens([await asyncio.wait_for(queue.get(), 5)]):
            pass  # until the first token
        await gateway.abort("long")
        await until(lambda: not demo_engine.has_unfinished_requests())
        assert free_blocks(demo_engine) == before
        assert demo_engine.stats().generation_tokens_total - generated < 600  # stopped early, not finished
    assert not bus.unacked


async def test_errors_reach_the_requester(bus, gateway) -> None:
    async with running(memory_worker(bus, FakeEngine())):
        bad_add = await until_finished(await submit(gateway, "add", [BOOM_ON_ADD], max_tokens=2))
        bad_params = await until_finished(await submit(gateway, "params", [1], wire={"max_tokens": -1}))
        bad_step = await until_finished(await submit(gateway, "step", [BOOM_ON_STEP], max_tokens=2))
    assert (bad_add[-1].kind, bad_add[-1].status) == (EventKind.ERROR, 500) and "boom" in bad_add[-1].error
    assert (bad_params[-1].kind, bad_params[-1].status) == (EventKind.ERROR, 400)
    assert (bad_step[-1].kind, bad_step[-1].status) == (EventKind.ERROR, 500) and "kaboom" in bad_step[-1].error


class BrokenEngine(FakeEngine):
    """Cannot abort (at module level: test_engine_protocol checks it against the Engine protocol)."""

    def abort_request(self, request_ids: list[str]) -> None:
        raise RuntimeError("cannot abort")


async def test_a_failed_step_ends_every_request_even_if_aborts_fail(bus, gateway) -> None:
    """A step that raises fails every request it ran, each with an error event, even when the broken engine
    cannot abort them either."""
    # Both queued before the worker starts: one poll takes both, and the first step (which raises) runs both,
    # whatever the machine's speed (a healthy request sent first could finish before the bad one is pulled).
    healthy = await submit(gateway, "healthy", [1], max_tokens=2)
    bad_step = await submit(gateway, "step", [BOOM_ON_STEP], max_tokens=2)
    async with running(memory_worker(bus, BrokenEngine())):
        bad = await until_finished(bad_step)
        ended = await until_finished(healthy)
    assert [e.kind for e in ended] == [EventKind.ACCEPTED, EventKind.ERROR]  # not a token: it ended with the step
    for events in (bad, ended):
        assert (events[-1].kind, events[-1].status) == (EventKind.ERROR, 500) and "kaboom" in events[-1].error


class HeldEngine(FakeEngine):
    """Its steps hang until the test releases them (for 30 s at most: a failed test ends too)."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def step(self) -> list:
        self.released.wait(30)
        return super().step()


async def test_a_hung_step_stops_the_heartbeats(bus, gateway) -> None:
    engine = HeldEngine()
    async with running(memory_worker(bus, engine)):  # heartbeat TTL 1 s
        try:
            await until(lambda: "w0" in bus.live_beats())
            queue = await submit(gateway, "r1", [1], max_tokens=1)
            await asyncio.wait_for(queue.get(), 5)  # accepted: its step starts, and hangs
            await until(lambda: "w0" not in bus.live_beats())
        finally:
            engine.released.set()
        await until_finished(queue)
        await until(lambda: "w0" in bus.live_beats())  # beating again once the loop moves
