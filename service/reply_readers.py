"""A gateway's readers of out streams over Redis: one blocking reader of its own, and one of each other
gateway's whose requests clients resumed here (in a Redis Cluster two streams may lie in different slots, which
one XREAD cannot name together). Each hands the ReplyBatches it reads to ``deliver``."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.asyncio import Redis

from service.broker import BROKER_ERRORS, UNFINISHED_TTL_S, connect
from service.config import RedisConfig
from service.supervise import supervised
from service.transcript import CLOCK_SKEW_MS

log = logging.getLogger(__name__)


class ReplyReaders:
    def __init__(self, config: RedisConfig, poll_s: float, closing: asyncio.Event,
                 deliver: Callable[[bytes], None]) -> None:
        self._config = config
        self._poll_s = poll_s
        self._closing = closing  # set: every reader ends after its current read
        self._deliver = deliver
        self._cursors: dict[str, bytes] = {}  # out stream -> the last entry read from it, while it is read
        self.tasks: dict[str, asyncio.Task] = {}  # out stream -> its reader (the own one first)

    def start(self, client: Redis) -> None:
        self._client = client
        # The blocking read is never retried: its loop is, without re-sending a read Redis may have answered.
        self._blocking = connect(self._config, blocking=True)

    async def follow(self, key: str, name: str) -> None:
        """Reads ``key`` from its last entry on (what came before is the transcript's), unless already read."""
        if key not in self._cursors:
            self._cursors[key] = await self._last_id(key)
        if key not in self.tasks or self.tasks[key].done():
            self.tasks[key] = supervised(name, lambda: self._read(key), self._poll_s)

    def unfollow(self, key: str) -> None:
        self._cursors.pop(key, None)  # its reader ends after its current read

    def rewind(self) -> None:
        """Back by the clock skew the transcripts allow: another server stamps the next entries, and its clock
        may be behind the old one's."""
        self._cursors = {key: _rewound(cursor) for key, cursor in self._cursors.items()}

    def reread(self) -> None:
        """From each stream's start: a server that lost its state makes new streams, whose ids may lie below
        the cursors."""
        self._cursors = dict.fromkeys(self._cursors, b"0-0")

    async def wake(self, key: str) -> None:
        """An entry without a batch on ``key``: its blocking read returns (closing)."""
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.xadd(key, {"w": b""})
            pipe.expire(key, UNFINISHED_TTL_S, nx=True)  # an idle gateway's stream still expires
            await pipe.execute()
        except BROKER_ERRORS:
            pass  # then the read returns within block_ms, or fails

    async def close(self) -> None:
        await self._blocking.aclose()

    async def _read(self, key: str) -> None:
        """Reads one out stream while it is followed (the gateway's own: until closing)."""
        while not self._closing.is_set() and key in self._cursors:
            try:
                response = await self._blocking.xread({key: self._cursors[key]}, block=self._config.block_ms)
            except BROKER_ERRORS as exc:
                log.warning("reply reader: %s", type(exc).__name__)
                await asyncio.sleep(self._poll_s)
                continue
            for _, entries in response or []:
                if key in self._cursors:
                    self._cursors[key] = entries[-1][0]
                for _, fields in entries:
                    if b"b" in fields:  # a wake-up entry has none
                        self._deliver(fields[b"b"])

    async def _last_id(self, key: str) -> bytes:
        try:
            last = await self._client.xrevrange(key, count=1)
        except BROKER_ERRORS:
            return b"0-0"
        return last[0][0] if last else b"0-0"


def _rewound(cursor: bytes) -> bytes:
    millis = int(cursor.partition(b"-")[0])
    return f"{max(millis - CLOCK_SKEW_MS, 0)}-0".encode()
