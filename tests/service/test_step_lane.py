"""The step lane (service/step_lane.py) against a real redis-server: its RESP encoding and raw replies, its
failures (closed, retried no sooner than asked), and a worker that serves through it, and without it when
it cannot connect, with the same tokens."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import redis
from redis.exceptions import ResponseError

from service.broker import sync_client
from service.config import RedisConfig
from service.redis_keys import Keys
from service import step_lane
from service.step_lane import StepLane, encode_commands
from tests.service.conftest import MODEL_NAME, running
from tests.service.fake_engine import FakeEngine
from tests.service import test_worker_redis
from tests.service.test_worker_redis import (finished, make_worker, request_fields, settled, submit, tokens,
                                             until_async)

client = test_worker_redis.client  # the fixture: a client of the test's prefix, its gateway beating


def test_encode_commands_is_resp() -> None:
    assert encode_commands([("SET", "k", b"v\r\n", "EX", 5)]) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n$2\r\nEX\r\n$1\r\n5\r\n")


async def test_replies_in_order_errors_in_place(redis_config: RedisConfig, client) -> None:
    lane, key = StepLane(redis_config, retry_s=0.5), f"{redis_config.prefix}:k"
    payload = bytes(range(256)) * 4  # binary-safe: CR LF and NULs inside
    assert lane.send([("SET", key, payload, "EX", 60), ("GET", key), ("XADD", key, "*", "f", "v"),
                      ("SET", key, "other", "NX", "GET")])
    ok, value, wrongtype, old = lane.receive()
    assert ok == b"OK" and value == payload and old == payload
    assert isinstance(wrongtype, ResponseError) and "WRONGTYPE" in str(wrongtype)
    assert await client.get(key) == payload  # NX: not overwritten
    lane.close()


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The step lane's monotonic clock, set by the test (the event loop keeps the real one)."""
    now = [100.0]
    monkeypatch.setattr(step_lane, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


async def test_a_failed_exchange_closes_the_lane_until_retry(redis_config: RedisConfig, client, clock) -> None:
    lane = StepLane(redis_config, retry_s=0.5)
    assert lane.send([("CLIENT", "SETNAME", "lane-under-test")]) and lane.receive() == [b"OK"]
    await client.client_kill_filter(_type="normal", skipme=True)  # the link drops under the lane
    lane.send([("PING",)])  # the write may still go out into the dead socket: the reply never comes
    assert lane.receive() is None and not lane.ready()
    clock[0] += 0.25  # (binary fractions: the clock's sums are exact)
    assert not lane.ready()
    clock[0] += 0.25
    assert lane.ready() and lane.send([("PING",)]) and lane.receive() == [b"PONG"]  # a new connection
    lane.close()


def test_an_unreachable_redis_is_tried_once_per_interval(monkeypatch, clock) -> None:
    attempts, connect = [], redis.connection.Connection._connect
    monkeypatch.setattr(redis.connection.Connection, "_connect", lambda self: attempts.append(1) or connect(self))
    lane = StepLane(RedisConfig(url="redis://127.0.0.1:1"), retry_s=60)
    assert not lane.send([("PING",)]) and lane.receive() is None
    assert len(attempts) == 1 and not lane.ready()  # one connect, no retries within it
    clock[0] += 59.5
    assert not lane.ready()
    clock[0] += 0.5
    assert lane.ready()


def after_start(worker, patch) -> None:
    """Runs ``patch(broker)`` once the worker's broker has started (its lane exists only then)."""
    start = worker.broker.start

    async def start_then_patch() -> None:
        await start()
        patch(worker.broker)
    worker.broker.start = start_then_patch


def record_lane_sends(broker, calls: list) -> None:
    lane_send = broker.lane.send
    broker.lane.send = lambda *args: calls.append(lane_send(*args)) or calls[-1]


@pytest.mark.parametrize("lane_works", [True, False])
async def test_the_worker_serves_with_or_without_the_lane(redis_config: RedisConfig, client, lane_works) -> None:
    keys, engine = Keys(redis_config.prefix), FakeEngine()
    worker = make_worker(redis_config, engine, step_lane=True)
    sends = []

    def patch(broker) -> None:
        if not lane_works:
            broker.lane._connection = StepLane(RedisConfig(url="redis://127.0.0.1:1"), retry_s=60)
        record_lane_sends(broker, sends)
    after_start(worker, patch)
    async with running(worker):
        await submit(client, keys, "r0", max_tokens=3)
        first = await asyncio.wait_for(finished(client, keys, "r0"), 5)
        for i in range(1, 4):  # each step of these goes through the lane when it works
            await submit(client, keys, f"r{i}", max_tokens=6)
        rest = [await asyncio.wait_for(finished(client, keys, f"r{i}"), 5) for i in range(1, 4)]
        await until_async(lambda: settled(client, keys))
    assert tokens(first) == [66, 67, 68] and all(tokens(events) == [66, 67, 68, 69, 70, 71] for events in rest)
    assert all([e.index for e in events] == list(range(6)) for events in rest)
    if lane_works:
        assert sends and any(call.replies is not None for call in sends)
    else:
        assert all(not call.sent for call in sends)  # tried, refused: the asyncio path served everything


def count_steps(engine: FakeEngine, before_step: dict[int, Callable[[], object]]) -> list[int]:
    """Counts the engine's steps (the list's one item); ``before_step[k]()`` runs as the step after the
    first k starts, on the thread that steps."""
    steps, step = [0], engine.step

    def counted_step():
        if (action := before_step.get(steps[0])) is not None:
            action()
        outputs = step()
        steps[0] += 1
        return outputs

    engine.step = counted_step
    return steps


@pytest.mark.parametrize("step_s, poll_after_step_s", [(0.05, 0.01), (0.0, 60.0)], ids=["long steps", "short steps"])
async def test_a_request_arriving_during_a_long_step_joins_the_next_one(redis_config: RedisConfig, client,
                                                                       step_s, poll_after_step_s) -> None:
    """While steps are long, the lane polls after each step: a request sent during step k is added before step
    k+1 (polled before step k, with its publish, it would wait for step k+1 to end). Short steps poll with
    the publish, before the step, and serve the same. The request is sent from inside step 3, and a step is
    long or short by the threshold whatever the machine's speed (a 0.05 s sleep, an instant step vs 60 s)."""
    keys, engine = Keys(redis_config.prefix), FakeEngine(step_s=step_s)
    added_after, calls, sender = {}, [], sync_client(redis_config, 5.0)
    worker = make_worker(redis_config, engine, step_lane=True, poll_after_step_s=poll_after_step_s)
    steps = count_steps(engine, {2: lambda: sender.xadd(keys.requests(MODEL_NAME), request_fields("short", 2))})
    add_request = engine.add_request

    def counted_add(request_id, *args, **kwargs):
        added_after[request_id] = steps[0]
        return add_request(request_id, *args, **kwargs)

    engine.add_request = counted_add
    after_start(worker, lambda broker: record_lane_sends(broker, calls))
    async with running(worker):
        await submit(client, keys, "long", max_tokens=12)
        assert tokens(await asyncio.wait_for(finished(client, keys, "short"), 10)) == [66, 67]
        assert len(tokens(await asyncio.wait_for(finished(client, keys, "long"), 10))) == 12
    sender.close()
    assert all(call.poll_after == (step_s > 0) for call in calls[1:])  # the first follows no step
    if step_s:
        assert added_after["short"] == 3


async def test_a_failed_poll_after_the_step_loses_nothing(redis_config: RedisConfig, client) -> None:
    """The poll's own exchange, after a step that published, reaches Redis (the new entry is delivered) but its
    reply is lost: the publish stands, the next (asyncio) poll recovers the entry, and both requests finish
    with every token once. The second request is sent, and the failure armed, as the first's second step
    starts: 0.02 s steps are long (the lane polls after them), and the first has 6 more to go."""
    keys, engine = Keys(redis_config.prefix), FakeEngine(step_s=0.02)
    worker = make_worker(redis_config, engine, step_lane=True)
    armed, failed, sender = threading.Event(), [], sync_client(redis_config, 5.0)

    def send_second() -> None:
        sender.xadd(keys.requests(MODEL_NAME), request_fields("second", 4))
        armed.set()

    count_steps(engine, {1: send_second})

    def fail_one_poll(broker) -> None:
        lane = broker.lane._connection
        send, receive = lane.send, lane.receive

        def send_failing_once(commands):
            if armed.is_set() and not failed and commands and commands[0][0] == "XREADGROUP":
                failed.append(send(commands))
                receive()  # the entry is delivered to this consumer; the worker never sees the reply
                lane._fail()
                return False
            return send(commands)
        lane.send = send_failing_once
    after_start(worker, fail_one_poll)

    async with running(worker):
        await submit(client, keys, "first", max_tokens=8)
        second = await asyncio.wait_for(finished(client, keys, "second"), 10)
        first = await asyncio.wait_for(finished(client, keys, "first"), 10)
        await until_async(lambda: settled(client, keys))
    sender.close()
    assert failed, "no poll after a step failed"
    assert tokens(first) == list(range(66, 74)) and tokens(second) == [66, 67, 68, 69]
    assert [e.index for e in second] == list(range(4))
