"""The step lane (service/step_lane.py) against a real redis-server: its RESP encoding and raw replies, its
failures (closed, retried no sooner than asked), and a worker that serves through it, and without it when
it cannot connect, with the same tokens."""
from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ResponseError

from service.config import RedisConfig
from service.redis_keys import Keys
from service.step_lane import StepLane, encode_commands
from tests.service.conftest import running
from tests.service.fake_engine import FakeEngine
from tests.service import test_worker_redis
from tests.service.test_worker_redis import finished, make_worker, settled, submit, tokens, until_async

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


async def test_a_failed_exchange_closes_the_lane_until_retry(redis_config: RedisConfig, client) -> None:
    lane = StepLane(redis_config, retry_s=0.3)
    assert lane.send([("CLIENT", "SETNAME", "lane-under-test")]) and lane.receive() == [b"OK"]
    await client.client_kill_filter(_type="normal", skipme=True)  # the link drops under the lane
    lane.send([("PING",)])  # the write may still go out into the dead socket: the reply never comes
    assert lane.receive() is None and not lane.ready()
    time.sleep(0.35)
    assert lane.ready() and lane.send([("PING",)]) and lane.receive() == [b"PONG"]  # a new connection
    lane.close()


def test_an_unreachable_redis_is_tried_once_per_interval() -> None:
    lane = StepLane(RedisConfig(url="redis://127.0.0.1:1"), retry_s=60)
    started = time.monotonic()
    assert not lane.send([("PING",)]) and lane.receive() is None
    assert not lane.ready() and time.monotonic() - started < 1.5


@pytest.mark.parametrize("lane_works", [True, False])
async def test_the_worker_serves_with_or_without_the_lane(redis_config: RedisConfig, client, lane_works) -> None:
    keys, engine = Keys(redis_config.prefix), FakeEngine()
    worker = make_worker(redis_config, engine, step_lane=True)
    broker, sends = worker.broker, []
    start = broker.start

    async def start_with_lane() -> None:
        await start()
        if not lane_works:
            broker._lane = StepLane(RedisConfig(url="redis://127.0.0.1:1"), retry_s=60)
        lane_send = broker.lane_send
        broker.lane_send = lambda *args: sends.append(lane_send(*args)) or sends[-1]
    broker.start = start_with_lane
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
