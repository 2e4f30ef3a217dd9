"""A request names its served model and waits in that model's request stream: an
engine serving another model on the same broker never takes it."""
from __future__ import annotations

import asyncio
import time
import uuid

from engine import SamplingParams
from service.config import GatewayConfig, RedisConfig, WorkerConfig
from service.redis_gateway import RedisGatewayBroker
from service.redis_keys import Keys
from service.redis_worker import RedisWorkerBroker
from service.memory_broker import MemoryBus, MemoryGatewayBroker, MemoryWorkerBroker
from service.messages import EventKind, RequestMsg, StreamRecord, params_to_wire
from service.worker import Worker
from tests.service.conftest import MODEL_NAME, count_calls, memory_worker, running, until
from tests.service.fake_engine import FakeEngine

OTHER = "other-model"
WIRE = params_to_wire(SamplingParams(max_tokens=2))


def request(model: str, gateway_id: str = "g") -> RequestMsg:
    return RequestMsg(f"r-{uuid.uuid4().hex[:8]}", [1, 2], WIRE, gateway_id, time.time(), model)


def other_worker(bus: MemoryBus, engine: FakeEngine) -> Worker:
    config = WorkerConfig(engine_id="w-other", heartbeat_interval_s=0.05, heartbeat_ttl_s=1.0)
    return Worker(config, engine, OTHER, MemoryWorkerBroker(bus, config.engine_id, OTHER, 1.0, block_s=0.02))


async def test_an_engine_never_takes_another_models_requests() -> None:
    bus, other_engine, own_engine = MemoryBus(), FakeEngine(), FakeEngine()
    gateway = MemoryGatewayBroker(bus, GatewayConfig(engine_poll_s=0.05))
    await gateway.start()
    try:
        worker = other_worker(bus, other_engine)
        polls = count_calls(worker.broker, "poll")
        async with running(worker):
            queue = await gateway.submit(request(MODEL_NAME, gateway.gateway_id))
            seen = polls[0]
            await until(lambda: polls[0] >= seen + 3)  # the other model's worker polls meanwhile
            assert other_engine.added == [] and len(bus.queued[MODEL_NAME]) == 1
            async with running(memory_worker(bus, own_engine)):
                first = await asyncio.wait_for(queue.get(), 5)
        assert first.kind is EventKind.ACCEPTED and first.engine_id == "w0" and len(own_engine.added) == 1
    finally:
        await gateway.close()


async def test_a_misrouted_request_is_refused_not_served() -> None:
    bus, engine = MemoryBus(), FakeEngine()
    gateway = MemoryGatewayBroker(bus, GatewayConfig(engine_poll_s=0.05))
    await gateway.start()
    try:
        queue = await gateway.submit(request(OTHER, gateway.gateway_id))
        bus.queued[MODEL_NAME].extend(bus.queued.pop(OTHER))  # as if it had landed in the wrong stream
        async with running(memory_worker(bus, engine)):
            events = [await asyncio.wait_for(queue.get(), 5) for _ in range(2)]
        assert events[1].kind is EventKind.ERROR and events[1].status == 404 and OTHER in events[1].error
        assert engine.added == []
    finally:
        await gateway.close()


async def test_each_model_has_its_own_redis_request_stream(redis_url: str) -> None:
    redis = RedisConfig(url=redis_url, prefix=f"t{uuid.uuid4().hex[:8]}", block_ms=100)
    assert Keys(redis.prefix).requests(MODEL_NAME) != Keys(redis.prefix).requests(OTHER)
    gateway = RedisGatewayBroker(GatewayConfig(redis=redis, engine_poll_s=0.1))
    own = RedisWorkerBroker(redis, "own", MODEL_NAME, reply_ttl_s=60, heartbeat_ttl_s=30)
    other = RedisWorkerBroker(redis, "other", OTHER, reply_ttl_s=60, heartbeat_ttl_s=30)
    for broker in (gateway, own, other):
        await broker.start()
    try:
        assert gateway.reachable
        msg = request(MODEL_NAME, gateway.gateway_id)
        await gateway.submit(msg, StreamRecord(msg.request_id, gateway.gateway_id, b"{}", [1], 0, 0, ""))
        assert (await other.poll(8, block=False))[0] == []
        pulled, _ = await own.poll(8, block=False)
        assert [p.msg.request_id for p in pulled] == [msg.request_id] and pulled[0].msg.model == MODEL_NAME
    finally:
        for broker in (gateway, own, other):
            await broker.close()
