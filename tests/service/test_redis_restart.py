"""Recovery from Redis restarted without persistence, over a real redis-server: the deployment's keys
deleted (queue, consumer group, owner keys, records, checkpoints, beats, out streams) while a worker and
a gateway keep their state in memory. The worker re-asserts what it runs (owner keys, checkpoints) and
drops what another engine claimed meanwhile; the gateway writes its StreamRecords again and queues
again the requests no engine accepted; a re-queued request that an engine still runs is not run twice."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from service.broker import connect
from service.broker_api import RequestHandle
from service.config import GatewayConfig, RedisConfig
from service.messages import (CONTROL_INDEX, EventKind, Heartbeat, Progress, ReplyBatch, ReplyEvent, RequestMsg,
                              StreamRecord, decode, decode_batch, encode_batch)
from service.redis_gateway import RedisGatewayBroker
from service.redis_keys import Keys
from service.redis_worker import RedisWorkerBroker
from tests.service.conftest import MODEL_NAME, engine_stats, running, until
from tests.service.fake_engine import FakeEngine
from tests.service.test_worker_redis import GATEWAY, beat_gateway, make_worker, submit, tokens, until_async


@pytest.fixture
def redis_config(redis_url: str) -> RedisConfig:
    return RedisConfig(url=redis_url, prefix=f"t{uuid.uuid4().hex[:8]}", block_ms=50)


@pytest.fixture
async def client(redis_config: RedisConfig) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_config)
    yield client
    await client.aclose()


async def lose_state(client: aioredis.Redis, prefix: str) -> None:
    """What a restart without persistence does to a deployment: every one of its keys is gone."""
    keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
    if keys:
        await client.delete(*keys)


def beat(engine_id: str) -> Heartbeat:
    return Heartbeat(engine_id, "inc", MODEL_NAME, 2048, engine_stats())


async def test_the_worker_broker_reasserts_missing_owner_keys_and_reports_other_claims(redis_config, client) -> None:
    keys = Keys(redis_config.prefix)
    broker = RedisWorkerBroker(redis_config, "w0", MODEL_NAME, reply_ttl_s=60, heartbeat_ttl_s=1.0)
    await broker.start()
    try:
        for rid in ("r1", "r2"):
            await submit(client, keys, rid, max_tokens=4)
        pulled, _ = await broker.poll(2, block=False)
        handles = [p.handle for p in pulled]
        await broker.heartbeat(beat("w0"))
        assert broker.lost_state  # the first beat found no key: nothing is lost, taken_over says so
        assert await broker.taken_over(handles) == [] and not broker.lost_state
        await broker.heartbeat(beat("w0"))
        assert not broker.lost_state

        await lose_state(client, redis_config.prefix)
        await client.set(keys.owner("r2"), "w1/other")  # another engine claimed r2 meanwhile
        await broker.heartbeat(beat("w0"))
        assert broker.lost_state
        assert [h.request_id for h in await broker.taken_over(handles)] == ["r2"]
        assert await client.get(keys.owner("r1")) == broker.consumer.encode()
        assert not broker.lost_state

        await submit(client, keys, "r1", max_tokens=4)  # a gateway queues r1 again: its entry was lost
        assert (await broker.poll(2, block=False))[0] == []  # NOGROUP: the group is made again, from entry 0
        assert (await broker.poll(2, block=False))[0] == []  # r1's entry: a duplicate of a request it runs
        assert await client.xlen(keys.requests(MODEL_NAME)) == 0
    finally:
        await broker.close()


async def test_a_missing_owner_key_is_not_another_engines_claim(redis_config, client) -> None:
    """A stalled worker (beat gap past the TTL) whose requests' owner keys are gone keeps them."""
    broker = RedisWorkerBroker(redis_config, "w0", MODEL_NAME, reply_ttl_s=60, heartbeat_ttl_s=1.0)
    await broker.start()
    try:
        handle = RequestHandle("r1", GATEWAY, b"1-0")
        assert await broker.taken_over([handle]) == []
        assert await client.get(Keys(redis_config.prefix).owner("r1")) == broker.consumer.encode()
    finally:
        await broker.close()


async def test_a_worker_keeps_serving_and_reasserts_its_request_after_redis_lost_its_state(redis_config,
                                                                                            client) -> None:
    keys, engine = Keys(redis_config.prefix), FakeEngine(step_s=0.01)
    await beat_gateway(client, keys, GATEWAY)
    await submit(client, keys, "r1", max_tokens=150)
    events = OutStream(client, keys.out(GATEWAY))
    worker = make_worker(redis_config, engine)
    async with running(worker), events:
        await until(lambda: events.count("r1") >= 10)
        await lose_state(client, redis_config.prefix)
        await beat_gateway(client, keys, GATEWAY)  # a live gateway beats again at once
        consumer = f"w0/{worker.incarnation}".encode()
        await until_async(lambda: owned_and_checkpointed(client, keys, "r1", consumer))
        await submit(client, keys, "r1", max_tokens=150)  # what a gateway queues again: not run twice
        await until(lambda: events.finished("r1"), 10)
    kept = events.kept("r1")
    assert tokens(kept) == [66 + i for i in range(150)] and [e.index for e in kept] == list(range(150))
    assert engine.added == ["r1"]


async def owned_and_checkpointed(client: aioredis.Redis, keys: Keys, request_id: str, consumer: bytes) -> bool:
    owner, progress = await client.mget([keys.owner(request_id), keys.progress(request_id)])
    return owner == consumer and progress is not None and decode(Progress, progress).next_index > 0


class OutStream:
    """A gateway's out stream read from the start, across the loss of Redis's state (the read cursor is a
    time: entries of the new stream come after it)."""

    def __init__(self, client: aioredis.Redis, key: str) -> None:
        self.client, self.key = client, key
        self.events: list[tuple[str, ReplyEvent]] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> OutStream:
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *_: object) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _read(self) -> None:
        cursor = b"0-0"
        while True:
            for _, entries in await self.client.xread({self.key: cursor}, block=50) or []:
                for cursor, fields in entries:
                    self.events += decode_batch(fields[b"b"]).events if b"b" in fields else []

    def count(self, request_id: str) -> int:
        return len(self.kept(request_id))

    def kept(self, request_id: str) -> list[ReplyEvent]:
        """What a gateway passes on: counted events in index order, once each, never with a gap."""
        kept: list[ReplyEvent] = []
        for rid, event in self.events:
            if rid == request_id and event.index != CONTROL_INDEX:
                assert event.index <= len(kept), f"gap: event {event.index} after {len(kept)}"
                kept += [event] if event.index == len(kept) else []
        return kept

    def finished(self, request_id: str) -> bool:
        kept = self.kept(request_id)
        return bool(kept) and kept[-1].finished


async def test_a_gateway_restores_its_records_and_requeues_what_no_engine_accepted(redis_config, client) -> None:
    keys = Keys(redis_config.prefix)
    gateway = RedisGatewayBroker(GatewayConfig(redis=redis_config, engine_poll_s=0.05))
    await gateway.start()
    try:
        queues = {}
        for rid in ("r1", "r2"):
            msg = RequestMsg(rid, [1], {}, gateway.gateway_id, time.time(), MODEL_NAME)
            queues[rid] = await gateway.submit(msg, StreamRecord(rid, gateway.gateway_id, b"{}", [1], 0, 0, ""))
        accepted = ReplyEvent(EventKind.ACCEPTED, "w0", "inc", index=CONTROL_INDEX)
        await client.xadd(keys.out(gateway.gateway_id), {"b": encode_batch(ReplyBatch("w0", "inc", [("r1", accepted)]))})
        assert (await asyncio.wait_for(queues["r1"].get(), 5)).kind is EventKind.ACCEPTED

        await lose_state(client, redis_config.prefix)
        await until_async(lambda: queued_requests(client, keys), 5)
        assert await client.exists(keys.request("r1"), keys.request("r2")) == 2
        await asyncio.sleep(0.3)  # several beats later: queued again once only
        assert await queued_requests(client, keys) == ["r2"]
    finally:
        await gateway.close()


async def queued_requests(client: aioredis.Redis, keys: Keys) -> list[str]:
    return [decode(RequestMsg, fields[b"p"]).request_id for _, fields in await client.xrange(keys.requests(MODEL_NAME))]
