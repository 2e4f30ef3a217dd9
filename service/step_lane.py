"""A blocking Redis connection for the engine's step thread: a pipeline goes out just before a step and
its replies, waiting in the socket meanwhile, are read just after it.

Why not the worker's asyncio client: each of its pipelines costs an event-loop wake-up, redis-py's
command objects and a thread hand-off, paid with cold caches after every step (~9 us of worker CPU per
token at 256 streams and an 8.5 ms step, loadtest/bench_broker.py). Riding on the step thread, with the
commands encoded here in one buffer, the same traffic costs ~2 us a token. redis-py still makes the
connection (TLS, ACL user, password, unix sockets) and parses the replies (hiredis).

One caller thread at a time. A failed exchange closes the connection: what it sent may have landed in
part, so its caller treats it as failed whole (the commands it carries are safe to send again). The next
connection is tried no sooner than ``retry_s`` later, so an unreachable Redis costs a step one connect
attempt at most that often.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import redis
from redis.exceptions import ResponseError

from service.broker import BROKER_ERRORS, sync_client
from service.config import RedisConfig

Command = Sequence[bytes | str | int]
_TIMEOUT_S = 1.0  # a reply Redis owes right after the step; past this the lane gives way to the asyncio client


def encode_commands(commands: Sequence[Command]) -> bytes:
    """RESP arrays of bulk strings, one per command, in one buffer."""
    out = []
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            out.append(b"$%d\r\n" % len(data))
            out.append(data)
            out.append(b"\r\n")
    return b"".join(out)


class StepLane:
    def __init__(self, config: RedisConfig, retry_s: float) -> None:
        self._client = sync_client(config, _TIMEOUT_S)
        if self._client is None:
            raise ValueError("a Redis Cluster has no step lane: one connection reaches one node's slots")
        self._connection: redis.connection.Connection | None = None
        self._retry_s = retry_s
        self._failed_at = float("-inf")
        self._sent = 0  # commands whose replies are owed

    def ready(self) -> bool:
        """Connected, or due for another try."""
        return self._connection is not None or time.monotonic() - self._failed_at >= self._retry_s

    def send(self, commands: Sequence[Command]) -> bool:
        """Writes the commands (connecting first if needed); False if that failed (the lane is closed)."""
        try:
            if self._connection is None:
                self._connection = self._client.connection_pool.get_connection()
            self._connection.send_packed_command([encode_commands(commands)], check_health=False)
        except BROKER_ERRORS:
            self._fail()
            return False
        self._sent = len(commands)
        return True

    def receive(self) -> list | None:
        """The replies to the last ``send``, in order (a command's error reply as its ResponseError); None
        if the connection failed before all of them arrived (the lane is closed)."""
        replies, self._sent = [None] * self._sent, 0
        if self._connection is None:
            return None
        try:
            for i in range(len(replies)):
                try:
                    replies[i] = self._connection.read_response()
                except ResponseError as exc:
                    replies[i] = exc
        except BROKER_ERRORS:
            self._fail()
            return None
        return replies

    def close(self) -> None:
        self._client.close()
        self._connection = None

    def _fail(self) -> None:
        if self._connection is not None:
            self._connection.disconnect()
            self._client.connection_pool.release(self._connection)
        self._connection, self._failed_at = None, time.monotonic()
