"""Recovery from Redis restarted without persistence, over a real redis-server: the deployment's keys
deleted (queue, consumer group, owner keys, records, checkpoints, beats, out streams) while a worker and
a gateway keep their state in memory. The worker re-asserts what it runs (owner keys, checkpoints) and
drops what another engine claimed meanwhile; the gateway writes its StreamRecords again and queues
again the requests no engine accepted; a re-queued request that an engine still runs is not run twice."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from service.broker import connect
from service.broker_api import RequestHandle
from service.config import GatewayConfig, RedisConfig
from service.messages import (CONTROL_INDEX, ChoiceDelta, EventKind, Heartbeat, Progress, ReplyBatch, ReplyEvent,
                              RequestMsg, StreamRecord, decode, decode_batch, encode, encode_batch)
from service.redis_gateway import RedisGatewayBroker
from service.redis_keys import RESUMES, Keys
from service.redis_worker import RedisWorkerBroker
from service.transcript import Transcript
from tests.service.conftest import MODEL_NAME, count_calls, engine_stats, running, until
from tests.service.fake_engine import FakeEngine
from tests.service.test_worker_redis import GATEWAY, beat_gateway, generated, make_worker, submit, tokens, until_async


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


async def publish(client: aioredis.Redis, out: str, batch: ReplyBatch) -> None:
    """What an engine's publish writes to a gateway's out stream."""
    await client.xadd(out, {"b": encode_batch(batch)})


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
        assert (await broker.heartbeat(beat("w0"))).state_lost  # the first beat found no key: nothing is lost,
        assert await broker.taken_over(handles) == []  # taken_over says so
        assert not (await broker.heartbeat(beat("w0"))).state_lost

        await lose_state(client, redis_config.prefix)
        await client.set(keys.owner("r2"), "w1/other")  # another engine claimed r2 meanwhile
        assert (await broker.heartbeat(beat("w0"))).state_lost
        assert [h.request_id for h in await broker.taken_over(handles)] == ["r2"]
        assert await client.get(keys.owner("r1")) == broker.consumer.encode()
        assert not (await broker.heartbeat(beat("w0"))).state_lost  # re-asserted: the key is there again

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
        await until(lambda: events.finished("r1"))
    kept = events.kept("r1")
    assert tokens(kept) == [66 + i for i in range(150)] and [e.index for e in kept] == list(range(150))
    assert engine.added == ["r1"]


@pytest.mark.parametrize("step_lane", [False, True])
async def test_a_worker_sends_again_what_redis_lost_before_a_gateway_read_it(redis_config, client, step_lane) -> None:
    """Redis acked the replies, then restarted empty: a gateway that had read none of them gets them all
    from the new out stream, followed by the rest, each once."""
    keys, engine = Keys(redis_config.prefix), FakeEngine(step_s=0.01)
    await beat_gateway(client, keys, GATEWAY)
    await submit(client, keys, "r1", max_tokens=150)
    # Every reply sent stays within the replay window (the worker's 5 s would depend on the machine's speed).
    async with running(make_worker(redis_config, engine, step_lane=step_lane, replay_window_s=600)):
        await until(lambda: generated(engine, "r1") >= 10)  # 10 tokens generated, 140 to go
        await until_async(lambda: client.xlen(keys.out(GATEWAY)), 5)  # some steps' replies landed, unread
        await lose_state(client, redis_config.prefix)
        await beat_gateway(client, keys, GATEWAY)
        async with OutStream(client, keys.out(GATEWAY)) as events:  # the new stream only
            await until(lambda: events.finished("r1"))
    kept = events.kept("r1")
    assert tokens(kept) == [66 + i for i in range(150)] and [e.index for e in kept] == list(range(150))


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
        """What a gateway passes on: counted events in index order, once each (the first copy), those past
        a gap held until it fills."""
        first: dict[int, ReplyEvent] = {}
        for rid, event in self.events:
            if rid == request_id and event.index != CONTROL_INDEX:
                first.setdefault(event.index, event)
        kept: list[ReplyEvent] = []
        while len(kept) in first:
            kept.append(first[len(kept)])
        return kept

    def finished(self, request_id: str) -> bool:
        kept = self.kept(request_id)
        return bool(kept) and kept[-1].finished


async def test_a_gateway_restores_its_records_and_requeues_what_no_engine_accepted(redis_config, client) -> None:
    keys = Keys(redis_config.prefix)
    gateway = RedisGatewayBroker(GatewayConfig(redis=redis_config, engine_poll_s=0.05))
    await gateway.start()
    try:
        queues = await submit_two(gateway)
        accepted = ReplyEvent(EventKind.ACCEPTED, "w0", "inc", index=CONTROL_INDEX)
        await publish(client, keys.out(gateway.gateway_id), ReplyBatch("w0", "inc", [("r1", accepted)]))
        assert (await asyncio.wait_for(queues["r1"].get(), 5)).kind is EventKind.ACCEPTED

        await lose_state(client, redis_config.prefix)
        await until_async(lambda: queued_requests(client, keys), 5)
        assert await client.exists(keys.request("r1"), keys.request("r2")) == 2
        await several_beats(gateway)
        assert await queued_requests(client, keys) == ["r2"]  # queued again once only
        # The new Redis's clock is behind the old one's: its out-stream ids are below the reader's cursor.
        output = ReplyEvent(EventKind.OUTPUT, "w0", "inc", [ChoiceDelta(0, [66])], index=0)
        await client.xadd(keys.out(gateway.gateway_id), {"b": encode_batch(ReplyBatch("w0", "inc", [("r1", output)]))},
                          id="1-1")
        assert (await asyncio.wait_for(queues["r1"].get(), 5)).index == 0
    finally:
        await gateway.close()


async def test_a_gateway_whose_beat_expired_alone_queues_nothing_again(redis_config, client) -> None:
    """A stall past the gateway TTL expires its beat key but loses no record and no queue entry."""
    keys = Keys(redis_config.prefix)
    gateway = RedisGatewayBroker(GatewayConfig(redis=redis_config, engine_poll_s=0.05))
    await gateway.start()
    try:
        msg = RequestMsg("r1", [1], {}, gateway.gateway_id, time.time(), MODEL_NAME)
        await gateway.submit(msg, StreamRecord("r1", gateway.gateway_id, b"{}", [1], 0, 0, ""))
        await client.delete(keys.gateway(gateway.gateway_id))
        await until_async(lambda: client.exists(keys.gateway(gateway.gateway_id)), 5)
        await several_beats(gateway)
        assert await queued_requests(client, keys) == ["r1"]
    finally:
        await gateway.close()


async def several_beats(gateway: RedisGatewayBroker) -> None:
    """Until the gateway has beaten 3 more times (each beat may queue requests again)."""
    beats = count_calls(gateway, "_beat")
    await until(lambda: beats[0] >= 3)


async def submit_two(gateway: RedisGatewayBroker) -> dict[str, asyncio.Queue[ReplyEvent]]:
    """Requests r1 and r2, submitted through ``gateway``: their reply queues."""
    queues = {}
    for rid in ("r1", "r2"):
        msg = RequestMsg(rid, [1], {}, gateway.gateway_id, time.time(), MODEL_NAME)
        queues[rid] = await gateway.submit(msg, StreamRecord(rid, gateway.gateway_id, b"{}", [1], 0, 0, ""))
    return queues


async def queued_requests(client: aioredis.Redis, keys: Keys) -> list[str]:
    return [decode(RequestMsg, fields[b"p"]).request_id for _, fields in await client.xrange(keys.requests(MODEL_NAME))]


async def test_a_requeued_resume_is_taken_over_only_from_a_dead_owner(redis_config, client) -> None:
    """A gateway's re-queue (field RESUMES) of a request whose owner is dead is resumed from its transcript;
    one whose owner lives, or a plain duplicate entry of a dead owner's request, is dropped."""
    keys = Keys(redis_config.prefix)
    broker = RedisWorkerBroker(redis_config, "w0", MODEL_NAME, reply_ttl_s=60, heartbeat_ttl_s=1.0)
    await broker.start()
    try:
        await client.set(keys.engine("w1"), encode(beat("w1")))  # w1/inc lives; w2/inc is dead
        delivered = [ReplyEvent(EventKind.OUTPUT, "w2", "inc", [ChoiceDelta(0, [66 + i])], index=i) for i in range(3)]
        await publish(client, keys.out(GATEWAY), ReplyBatch("w2", "inc", [("r1", e) for e in delivered]))
        for rid, owner, fields in (("r1", "w2/inc", {RESUMES: b""}), ("r2", "w1/inc", {RESUMES: b""}),
                                   ("r3", "w2/inc", {})):
            await client.set(keys.owner(rid), owner)
            msg = RequestMsg(rid, [1], {"max_tokens": 8}, GATEWAY, time.time(), MODEL_NAME)
            await client.xadd(keys.requests(MODEL_NAME), {"p": encode(msg), **fields})
        pulled, _ = await broker.poll(3, block=False)
        assert [p.msg.request_id for p in pulled] == ["r1"]
        assert pulled[0].resume.choices(1)[0] == [[66, 67, 68]] and pulled[0].resume.next_index == 3
        assert await client.get(keys.owner("r1")) == broker.consumer.encode()
        assert await client.mget(keys.owner("r2"), keys.owner("r3")) == [b"w1/inc", b"w2/inc"]
        assert await client.xlen(keys.requests(MODEL_NAME)) == 1  # only r1's entry is left, pending here
    finally:
        await broker.close()


async def test_a_gateway_requeues_as_a_resume_a_request_whose_engine_died_after_the_loss(redis_config,
                                                                                        client) -> None:
    """After the loss, r1 (checkpointed since) and r2 (events delivered, no checkpoint) lose their
    engine: r1 is queued again as a resume; r2's transcript would not be whole, it fails at the deadline."""
    keys = Keys(redis_config.prefix)
    await client.set(keys.engine("w0"), encode(beat("w0")))
    await client.sadd(keys.engines, "w0")
    gateway = RedisGatewayBroker(GatewayConfig(redis=redis_config, engine_poll_s=0.05, resume_deadline_s=0.6))
    await gateway.start()
    try:
        queues = await submit_two(gateway)
        events = [("r1", ReplyEvent(EventKind.ACCEPTED, "w0", "inc", index=CONTROL_INDEX)),
                  ("r2", ReplyEvent(EventKind.ACCEPTED, "w0", "inc", index=CONTROL_INDEX)),
                  ("r2", ReplyEvent(EventKind.OUTPUT, "w0", "inc", [ChoiceDelta(0, [66])], index=0))]
        await publish(client, keys.out(gateway.gateway_id), ReplyBatch("w0", "inc", events))
        await until(lambda: queues["r2"].qsize() == 2)

        await lose_state(client, redis_config.prefix)  # and w0 dies: it never beats again
        await until_async(lambda: client.exists(keys.request("r1")), 5)
        await client.set(keys.progress("r1"), encode(Progress("r1", 0, [[]], [None], None, 0, 0)))
        await until_async(lambda: client.xlen(keys.requests(MODEL_NAME)), 5)
        [(_, fields)] = await client.xrange(keys.requests(MODEL_NAME))
        assert decode(RequestMsg, fields[b"p"]).request_id == "r1" and RESUMES.encode() in fields
        error = await asyncio.wait_for(last(queues["r2"], EventKind.ERROR), 5)
        assert error.status == 503
    finally:
        await gateway.close()


async def last(queue: asyncio.Queue[ReplyEvent], kind: EventKind) -> ReplyEvent:
    while (event := await queue.get()).kind is not kind:
        pass
    return event


async def test_a_resume_after_the_loss_cannot_replay_the_lost_replies(redis_config, client) -> None:
    """A client reconnecting (``Last-Event-ID``) after the loss: its record is back, the replies before
    the loss are not; it gets an error event naming the lost ones, not a replay with a hole."""
    keys = Keys(redis_config.prefix)
    first = RedisGatewayBroker(GatewayConfig(redis=redis_config, engine_poll_s=0.05))
    second = RedisGatewayBroker(GatewayConfig(redis=redis_config, engine_poll_s=0.05))
    await first.start()
    await second.start()
    try:
        msg = RequestMsg("r1", [1], {}, first.gateway_id, time.time(), MODEL_NAME)
        record = StreamRecord("r1", first.gateway_id, b"{}", [1], 0, int(time.time() * 1000), "")
        queue = await first.submit(msg, record)
        out = keys.out(first.gateway_id)
        await publish(client, out, ReplyBatch("w0", "inc", [("r1", token(0)), ("r1", token(1))]))
        await until(lambda: queue.qsize() == 2)
        await lose_state(client, redis_config.prefix)
        await until_async(lambda: client.exists(keys.request("r1")), 5)
        await publish(client, out, ReplyBatch("w0", "inc", [("r1", token(2))]))
        resumed = await second.resume("r1", "")
        error = await asyncio.wait_for(last(resumed.queue, EventKind.ERROR), 5)
        assert error.error == "lost reply events 0..1"
    finally:
        await second.close()
        await first.close()


def token(index: int) -> ReplyEvent:
    return ReplyEvent(EventKind.OUTPUT, "w0", "inc", [ChoiceDelta(0, [66 + index])], index=index)


def test_a_transcript_notes_a_hole_only_where_it_cannot_be_continued() -> None:
    lost = Transcript(None)
    for index in (3, 4):  # only the events published after the loss are left
        lost.add(token(index))
    assert lost.hole_before == 3 and lost.next_index == 0
    late = Transcript(None)
    for index in (0, 2, 1):  # out of order for a moment (two engines), the end still reachable
        late.add(token(index))
    assert late.hole_before is None and late.next_index == 2
    done = Transcript(None)
    for event in (token(0), ReplyEvent(EventKind.OUTPUT, "w0", "inc", [], finished=True, index=1), token(5)):
        done.add(event)
    assert done.finished and done.hole_before is None
