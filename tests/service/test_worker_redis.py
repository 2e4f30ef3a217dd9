"""The worker over a real redis-server, on the v5 wire, read back as a gateway would (decode_batch of its out
stream, dedup by index): duplicated entries, a Redis outage mid-stream, resuming a dead engine's request,
dead-lettering, draining, orphans of a gone gateway, and an engine that keeps failing."""
from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from engine import SamplingParams
from service.broker import GROUP, connect
from service.config import RedisConfig, WorkerConfig
from service.messages import (CONTROL_INDEX, ChoiceDelta, EventKind, GatewayBeat, ReplyBatch, ReplyEvent,
                              RequestMsg, decode_batch, encode, encode_batch, params_to_wire)
from service.redis_keys import Keys
from service.local_stack import free_port
from service.redis_worker import RedisWorkerBroker
from service.worker import EXIT_FAILED_STEPS, Worker
from tests.service.conftest import MODEL_NAME, count_calls, running, until
from tests.service.fake_engine import BOOM_ON_STEP, FAIL_ON_STEP, FakeEngine

GATEWAY = "gw1"


@pytest.fixture
async def client(redis_config: RedisConfig) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_config)
    await beat_gateway(client, Keys(redis_config.prefix), GATEWAY)
    yield client
    await client.aclose()


def make_worker(redis: RedisConfig, engine: FakeEngine, engine_id: str = "w0", **options) -> Worker:
    config = WorkerConfig(redis=redis, engine_id=engine_id, heartbeat_interval_s=0.05, heartbeat_ttl_s=0.3,
                          checkpoint_interval_s=0.05, **{"drain_timeout_s": 0.5, **options})
    broker = RedisWorkerBroker(redis, engine_id, MODEL_NAME, config.reply_ttl_s, config.heartbeat_ttl_s)
    return Worker(config, engine, MODEL_NAME, broker)




async def beat_gateway(client: aioredis.Redis, keys: Keys, gateway_id: str, adopted: list[str] = ()) -> None:
    await client.set(keys.gateway(gateway_id), encode(GatewayBeat(gateway_id, list(adopted))), px=60_000)
    await client.sadd(keys.gateways, gateway_id)


async def submit(client: aioredis.Redis, keys: Keys, request_id: str, max_tokens: int, prompt: list[int] = (1,),
                 gateway_id: str = GATEWAY) -> None:
    await client.xadd(keys.requests(MODEL_NAME), request_fields(request_id, max_tokens, prompt, gateway_id))


def request_fields(request_id: str, max_tokens: int, prompt: list[int] = (1,), gateway_id: str = GATEWAY) -> dict:
    """A request stream entry's fields, as a gateway writes them."""
    wire = params_to_wire(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return {"p": encode(RequestMsg(request_id, list(prompt), wire, gateway_id, time.time(), MODEL_NAME))}


async def replies(client: aioredis.Redis, keys: Keys, request_id: str,
                  gateway_id: str = GATEWAY) -> tuple[list[ReplyEvent], list[ReplyEvent]]:
    """(every counted event on the wire, those a gateway keeps: in index order, duplicates dropped)."""
    wire = [event for _, fields in await client.xrange(keys.out(gateway_id))
            for rid, event in decode_batch(fields[b"b"]).events if rid == request_id and event.index != CONTROL_INDEX]
    kept: list[ReplyEvent] = []
    for event in wire:
        assert event.index <= len(kept), f"gap: event {event.index} after {len(kept)}"
        if event.index == len(kept):
            kept.append(event)
    return wire, kept


async def finished(client: aioredis.Redis, keys: Keys, request_id: str, gateway_id: str = GATEWAY) -> list[ReplyEvent]:
    async def done() -> bool:
        _, kept = await replies(client, keys, request_id, gateway_id)
        return bool(kept) and kept[-1].finished

    while not await done():
        await asyncio.sleep(0.02)
    return (await replies(client, keys, request_id, gateway_id))[1]


def tokens(events: list[ReplyEvent]) -> list[int]:
    return [t for e in events for c in e.choices for t in c.token_ids]


async def settled(client: aioredis.Redis, keys: Keys) -> bool:
    """Every entry acked and deleted."""
    stream = keys.requests(MODEL_NAME)
    return await client.xlen(stream) == 0 and (await client.xpending(stream, GROUP))["pending"] == 0


@pytest.mark.parametrize("step_lane", [True, False])
async def test_a_duplicated_entry_runs_once(redis_config, client, step_lane) -> None:
    keys, engine = Keys(redis_config.prefix), FakeEngine()
    for _ in range(2):  # a gateway's XADD retried after its first try landed
        await submit(client, keys, "r1", max_tokens=4)
    async with running(make_worker(redis_config, engine, step_lane=step_lane)):
        events = await asyncio.wait_for(finished(client, keys, "r1"), 5)
        await until_async(lambda: settled(client, keys))
    assert engine.added == ["r1"]
    assert tokens(events) == [66, 67, 68, 69] and [e.index for e in events] == [0, 1, 2, 3]


async def until_async(condition, timeout_s: float = 5.0) -> None:
    async def poll() -> None:
        while not await condition():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout_s)


class CuttableProxy:
    """A TCP proxy to Redis (on its unix socket) whose link can be cut (open connections reset, new ones
    refused) and restored."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.cut = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_unix_connection(self.socket_path)
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def sever(self) -> None:
        self.cut = True
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.sever()
        self._server.close()


@pytest.mark.parametrize("step_lane", [True, False])
async def test_replies_survive_a_redis_outage_nothing_lost_or_duplicated(redis_config, client, step_lane) -> None:
    proxy = CuttableProxy(client.connection_pool.connection_kwargs["path"])
    proxied = RedisConfig(url=f"redis://127.0.0.1:{await proxy.start()}/0", prefix=redis_config.prefix, block_ms=50)
    keys, engine = Keys(redis_config.prefix), FakeEngine(step_s=0.01)
    await submit(client, keys, "r1", max_tokens=150)
    try:
        async with running(make_worker(proxied, engine, step_lane=step_lane)):
            await until_async(lambda: replies(client, keys, "r1"), 5)  # a first batch landed
            await until(lambda: generated(engine, "r1") >= 20)
            proxy.sever()  # mid-stream, mid-pipeline
            await until(lambda: generated(engine, "r1") >= 50)  # still stepping: its replies wait in the outbox
            proxy.cut = False
            events = await asyncio.wait_for(finished(client, keys, "r1"), 10)
            await until_async(lambda: settled(client, keys))
    finally:
        await proxy.close()
    assert tokens(events) == [66 + i for i in range(150)]  # none lost, none twice
    assert [e.index for e in events] == list(range(150))


def generated(engine: FakeEngine, request_id: str) -> int:
    """The tokens the engine has generated for a request it runs (0 before it has it)."""
    return engine.requests.get(request_id, [0, 0])[1]


async def dead_consumer_takes(client: aioredis.Redis, keys: Keys, consumer: str) -> bytes:
    """Reads the next entry as ``consumer``, which then never beats: a dead engine's pending entry."""
    response = await client.xreadgroup(GROUP, consumer, {keys.requests(MODEL_NAME): ">"}, count=1)
    return response[0][1][0][0]


async def test_a_dead_engines_request_resumes_from_its_transcript(redis_config, client) -> None:
    keys, engine = Keys(redis_config.prefix), FakeEngine()
    await client.xgroup_create(keys.requests(MODEL_NAME), GROUP, id="0", mkstream=True)
    await submit(client, keys, "r1", max_tokens=8)
    await dead_consumer_takes(client, keys, "dead/inc0")
    await client.set(keys.owner("r1"), "dead/inc0")
    delivered = [(ReplyEvent(EventKind.ACCEPTED, "dead", "inc0"))] + [
        ReplyEvent(EventKind.OUTPUT, "dead", "inc0", [ChoiceDelta(0, [66 + i])], index=i) for i in range(3)]
    await client.xadd(keys.out(GATEWAY), {"b": encode_batch(ReplyBatch("dead", "inc0", [("r1", e) for e in delivered]))})
    await asyncio.sleep(0.3)  # idle past the heartbeat TTL
    async with running(make_worker(redis_config, engine)):
        events = await asyncio.wait_for(finished(client, keys, "r1"), 5)
        await until_async(lambda: settled(client, keys))
        await until_async(lambda: consumers_are(client, keys, ["w0/"]))  # the dead one is deleted
    assert engine.resumed["r1"].output_token_ids == [[66, 67, 68]]
    assert tokens(events) == [66 + i for i in range(8)] and [e.index for e in events] == list(range(8))
    assert await client.get(keys.owner("r1")) == f"w0/{engine_incarnation(events)}".encode()


async def test_a_resumed_greedy_request_continues_identically_on_the_real_engine(redis_config, client,
                                                                                 demo_engine) -> None:
    keys = Keys(redis_config.prefix)
    await submit(client, keys, "whole", max_tokens=12, prompt=[5, 6, 7])
    async with running(make_worker(redis_config, demo_engine)):
        whole = tokens(await asyncio.wait_for(finished(client, keys, "whole"), 10))
    await submit(client, keys, "r1", max_tokens=12, prompt=[5, 6, 7])  # the same, 5 tokens in when its engine died
    await dead_consumer_takes(client, keys, "dead/inc0")
    delivered = [ReplyEvent(EventKind.OUTPUT, "dead", "inc0", [ChoiceDelta(0, [t])], index=i)
                 for i, t in enumerate(whole[:5])]
    await client.xadd(keys.out(GATEWAY), {"b": encode_batch(ReplyBatch("dead", "inc0", [("r1", e) for e in delivered]))})
    await asyncio.sleep(0.3)
    async with running(make_worker(redis_config, demo_engine, engine_id="w1")):
        events = await asyncio.wait_for(finished(client, keys, "r1"), 10)
    assert tokens(events) == whole and [e.index for e in events] == list(range(len(events)))


def engine_incarnation(events: list[ReplyEvent]) -> str:
    return events[-1].incarnation


async def consumers_are(client: aioredis.Redis, keys: Keys, prefixes: list[str]) -> bool:
    names = [c["name"].decode() for c in await client.xinfo_consumers(keys.requests(MODEL_NAME), GROUP)]
    return len(names) == len(prefixes) and all(n.startswith(p) for n, p in zip(sorted(names), sorted(prefixes)))


async def test_a_request_that_failed_on_max_deliveries_engines_is_dead_lettered(redis_config, client) -> None:
    keys, engine = Keys(redis_config.prefix), FakeEngine()
    await client.xgroup_create(keys.requests(MODEL_NAME), GROUP, id="0", mkstream=True)
    await submit(client, keys, "r1", max_tokens=8)
    entry = await dead_consumer_takes(client, keys, "dead/a")
    for consumer in ("dead/b", "dead/c"):  # two more engines took it over, and died
        await client.xclaim(keys.requests(MODEL_NAME), GROUP, consumer, 0, [entry])
    await asyncio.sleep(0.3)
    async with running(make_worker(redis_config, engine, max_deliveries=3)):
        events = await asyncio.wait_for(finished(client, keys, "r1"), 5)
        await until_async(lambda: settled(client, keys))
    assert engine.added == []
    assert (events[0].kind, events[0].status, events[0].error) == (EventKind.ERROR, 500, "failed on 3 engines")
    [(_, fields)] = await client.xrange(keys.deadletter)
    assert (fields[b"r"], fields[b"e"], fields[b"why"]) == (b"r1", entry, b"failed on 3 engines")


class StoppedOnFirstAdd(FakeEngine):
    """SIGTERM reaches the worker as its engine takes the first request: at that step, whatever the machine's
    speed (a stop from the test, after it saw the request added, may come any number of steps later)."""

    def __init__(self, worker_of: list[Worker], **options) -> None:
        super().__init__(**options)
        self._worker_of = worker_of

    def add_request(self, *args, **kwargs) -> None:
        super().add_request(*args, **kwargs)
        self._worker_of[0].stop()


async def test_sigterm_drains_in_flight_requests_and_leaves_queued_ones(redis_config, client) -> None:
    keys, worker_of = Keys(redis_config.prefix), []
    engine = StoppedOnFirstAdd(worker_of)
    # One pull takes r1 alone; the drain (no time limit that matters) ends when r1 has all its 30 tokens.
    worker_of.append(make_worker(redis_config, engine, max_pull=1, drain_timeout_s=60))
    await submit(client, keys, "r1", max_tokens=30)
    await submit(client, keys, "r2", max_tokens=2)
    assert await asyncio.wait_for(worker_of[0].run(), 5) == 0
    assert tokens(await finished(client, keys, "r1")) == [66 + i for i in range(30)]
    assert engine.added == ["r1"] and await client.xlen(keys.requests(MODEL_NAME)) == 1  # r2 waits for another
    assert await client.get(keys.engine("w0")) is None


async def test_a_drain_past_its_timeout_leaves_the_rest_to_other_engines(redis_config, client) -> None:
    keys, worker_of = Keys(redis_config.prefix), []
    engine = StoppedOnFirstAdd(worker_of, step_s=0.01)  # 400 steps: 4 s at least, past the drain's 0.2 s
    worker_of.append(make_worker(redis_config, engine, drain_timeout_s=0.2))
    await submit(client, keys, "r1", max_tokens=400)
    assert await asyncio.wait_for(worker_of[0].run(), 5) == 0
    assert await client.get(keys.engine("w0")) is None  # dead at once for the others
    assert (await client.xpending(keys.requests(MODEL_NAME), GROUP))["pending"] == 1
    _, kept = await replies(client, keys, "r1")
    assert kept and not kept[-1].finished

    successor = FakeEngine()
    async with running(make_worker(redis_config, successor, engine_id="w1")):
        events = await asyncio.wait_for(finished(client, keys, "r1"), 10)
    assert successor.resumed["r1"].output_token_ids == [tokens(kept)]
    assert tokens(events) == [66 + i for i in range(400)]


async def test_requests_of_a_gone_gateway_are_aborted_unless_adopted(redis_config, client) -> None:
    keys, engine = Keys(redis_config.prefix), FakeEngine(step_s=0.01)
    await beat_gateway(client, keys, "gw2", adopted=["adopted"])
    for rid in ("orphan", "adopted"):
        await submit(client, keys, rid, max_tokens=10_000, gateway_id="gone")
    await submit(client, keys, "kept", max_tokens=10_000)
    worker = make_worker(redis_config, engine, orphan_grace_s=0.3)
    reads = count_calls(worker.broker, "gateways")  # once each heartbeat interval, with the orphans' check
    async with running(worker):
        events = await asyncio.wait_for(finished(client, keys, "orphan", gateway_id="gone"), 5)
        assert (events[-1].kind, events[-1].error) == (EventKind.ERROR, "the request's gateway is gone")
        seen = reads[0]
        await until(lambda: reads[0] >= seen + 3)  # more checks: the adopted one is never an orphan
        assert sorted(engine.requests) == ["adopted", "kept"]


@pytest.mark.parametrize("failure", [BOOM_ON_STEP, FAIL_ON_STEP], ids=["step raises", "step fails its request"])
async def test_consecutive_failed_steps_end_the_worker_non_zero(redis_config, client, failure: int) -> None:
    keys, engine = Keys(redis_config.prefix), FakeEngine()
    worker = make_worker(redis_config, engine, max_pull=1, max_failed_steps=3)
    for i in range(4):
        await submit(client, keys, f"r{i}", max_tokens=2, prompt=[failure])
    assert await asyncio.wait_for(worker.run(), 5) == EXIT_FAILED_STEPS
    for i in range(3):
        [event] = await finished(client, keys, f"r{i}")
        assert event.kind is EventKind.ERROR and event.error in ("engine step failed: kaboom", "device error")


async def test_an_engine_that_stalled_drops_the_requests_another_one_resumed(redis_config, client) -> None:
    keys, engine = Keys(redis_config.prefix), FakeEngine(step_s=0.01)
    await submit(client, keys, "r1", max_tokens=10_000)
    worker = make_worker(redis_config, engine)
    beats = count_calls(worker.broker, "heartbeat")
    async with running(worker):
        await until(lambda: "r1" in engine.requests)
        engine.step_s = 1.0  # a step hangs past the heartbeat TTL, and meanwhile another engine resumes r1
        await client.set(keys.owner("r1"), "w1/other")
        await until(lambda: "r1" not in engine.requests, timeout_s=3)
        engine.step_s = 0.01
        wire, _ = await replies(client, keys, "r1")
        seen = beats[0]
        await until(lambda: beats[0] >= seen + 3)  # beating again, and stepping
        assert (await replies(client, keys, "r1"))[0] == wire  # nothing more from the stalled engine
    assert (await client.xpending(keys.requests(MODEL_NAME), GROUP))["pending"] == 1  # the resumer acks it


async def _pings(client: aioredis.Redis) -> bool:
    try:
        return await client.ping()
    except aioredis.ConnectionError:
        return False


async def test_a_worker_started_while_redis_is_down_waits_for_it(tmp_path) -> None:
    """One fault may take Redis and an engine down together: the engine restarts first, waits for Redis
    (it would otherwise exit, with nothing to restart it) and serves once Redis is up."""
    port = free_port()
    redis = RedisConfig(url=f"redis://127.0.0.1:{port}/0", prefix="late", block_ms=50)
    worker = make_worker(redis, FakeEngine())
    attempts, ensure_groups = [0], worker.broker._ensure_groups

    async def attempt() -> None:
        attempts[0] += 1
        await ensure_groups()

    worker.broker._ensure_groups = attempt
    task = asyncio.create_task(worker.run())
    await until(lambda: attempts[0] >= 2)  # it tried, failed and tried again: still waiting, not exited
    assert not task.done()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    client = aioredis.Redis.from_url(redis.url)
    try:
        keys = Keys(redis.prefix)
        while not await _pings(client):
            await asyncio.sleep(0.05)
        await submit(client, keys, "r1", max_tokens=3)
        assert len(tokens(await finished(client, keys, "r1"))) == 3
    finally:
        worker.stop()
        await asyncio.wait_for(task, 10)
        await client.aclose()
        server.terminate()
        server.wait()
