"""A Redis worker's reads of its request streams and of the aborts.

XREADGROUP as consumer ``engine_id/incarnation``, from the stream of requests routed to this engine (by their
cached prefix, see ``service.routing``) and the model's shared stream, then each entry's request claimed
(``service.redis_claims``). After a failed read, the consumer's own pending entries are read back (id "0"):
a read that timed out after Redis delivered leaves nothing unprocessed.
"""
from __future__ import annotations

import time

import redis.asyncio as aioredis

from service.broker import GROUP
from service.broker_api import Pulled
from service.redis_claims import Claims, Entry, stream_entries
from service.redis_keys import Keys
from service.step_lane import Command


class Intake:
    def __init__(self, client: aioredis.Redis, blocking: aioredis.Redis, keys: Keys, consumer: str,
                 streams: tuple[str, ...], claims: Claims, block_ms: int) -> None:
        self._client = client
        self._blocking = blocking
        self._aborts = keys.aborts
        self._consumer = consumer
        self._streams = streams  # what was routed here goes first
        self._claims = claims
        self._block_ms = block_ms
        # Aborts from the last minute still matter: their requests may be queued.
        self._abort_cursor = f"{int(time.time() * 1000) - 60_000}-0".encode()
        self.recovering = False  # a read failed: Redis may have delivered entries that never arrived

    def reply_lost(self) -> None:
        """A read's reply was lost: the next ``poll`` reads this consumer's pending entries back first."""
        self.recovering = True

    async def poll(self, count: int, block: bool) -> tuple[list[Pulled], list[str]]:
        """Up to ``count`` new requests (waiting for one if ``block``) and new aborts."""
        recovered = await self._own_pending() if self.recovering else []
        self.recovering = False
        streams = {stream: ">" for stream in self._streams}
        if block and count:
            entries = await self._blocking.xreadgroup(GROUP, self._consumer, streams, count=count,
                                                      block=self._block_ms)
            aborts = await self._client.xread({self._aborts: self._abort_cursor})
        else:
            pipe = self._client.pipeline(transaction=False)
            if count:
                pipe.xreadgroup(GROUP, self._consumer, streams, count=count)
            pipe.xread({self._aborts: self._abort_cursor})
            results = await pipe.execute()
            entries, aborts = (results if count else ([], results[0]))
        pulled = (await self._claims.claim(recovered, mine_ok=True)
                  + await self._claims.claim(self._claims.not_running(stream_entries(entries)), mine_ok=False))
        return pulled, self.read_aborts(aborts)

    def poll_commands(self, count: int) -> list[Command]:
        """``poll``'s reads (non-blocking) as raw commands, for the step lane."""
        poll: list[Command] = [("XREADGROUP", "GROUP", GROUP, self._consumer, "COUNT", count, "STREAMS",
                                *self._streams, *(">",) * len(self._streams))] if count else []
        return poll + [("XREAD", "STREAMS", self._aborts, self._abort_cursor)]

    def read_aborts(self, response: list) -> list[str]:
        """The aborted request ids of an XREAD reply of the aborts stream; the cursor moves past them."""
        ids = []
        for _, entries in response or []:
            for entry_id, fields in entries:
                self._abort_cursor = entry_id
                ids.append(fields.get(b"r", b"").decode())
        return ids

    async def _own_pending(self) -> list[Entry]:
        """This consumer's pending entries it is not running (a read whose reply was lost). Listed with
        XPENDING and fetched with XRANGE: re-reading them with XREADGROUP would count a delivery each
        time, and a few link errors would dead-letter a healthy request."""
        found: list[Entry] = []
        for stream in self._streams:
            pending = await self._client.xpending_range(stream, GROUP, "-", "+", 1000, consumername=self._consumer)
            ids = [p["message_id"] for p in pending if not self._claims.runs(stream, p["message_id"])]
            if not ids:
                continue
            pipe = self._client.pipeline(transaction=False)
            for entry_id in ids:
                pipe.xrange(stream, entry_id, entry_id)
            found += [(stream, e, f) for entries in await pipe.execute() for e, f in entries if f]
        return found
