"""Dead engines' requests, for a Redis worker with room.

- Reclaim: the pending entries of dead consumers (their engine's heartbeat is gone or names another
  incarnation) are taken over with XCLAIM (atomic: once claimed, a second claimer's min-idle fails)
  and come back with their transcript, so the worker resumes them where the dead engine stopped; in the
  shared stream and in every engine's routed stream.
- Steal: an engine with room takes the entries another engine's routed stream left unread for
  ``steal_after_s`` (that engine is busy, or dead): routing never strands a request.
"""
from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from service.broker import GROUP, get_many
from service.broker_api import Pulled, read_request
from service.redis_claims import Claims, alive, stream_entries
from service.redis_keys import Keys, split_consumer

log = logging.getLogger(__name__)


class Reclaimer:
    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, consumer: str, own_stream: str,
                 claims: Claims, heartbeat_ttl_ms: int, steal_after_ms: int) -> None:
        self._client = client
        self._keys = keys
        self._model = model
        self._consumer = consumer
        self._own_stream = own_stream  # the stream of the requests routed to this engine
        self._claims = claims
        self._heartbeat_ttl_ms = heartbeat_ttl_ms
        self._steal_after_ms = steal_after_ms

    async def reclaim(self, room: int) -> list[Pulled]:
        """Up to ``room`` pending entries of dead consumers, claimed for this one, with their transcripts
        (``Pulled.resume``) and how many engines had them (``Pulled.deliveries``); then, with room left,
        entries other engines' routed streams left unread too long."""
        pulled: list[Pulled] = []
        engines = sorted(e.decode() for e in await self._client.smembers(self._keys.routed_engines(self._model)))
        routed = [self._keys.routed(self._model, engine_id) for engine_id in engines]
        for stream in [self._keys.requests(self._model), *routed]:
            for name, pending in await self._dead_consumers(stream):
                if not pending:
                    await self._client.xgroup_delconsumer(stream, GROUP, name)
                elif len(pulled) < room:
                    pulled += await self._claim_from(stream, name, room - len(pulled))
        if len(pulled) < room:
            pulled += await self._steal([s for s in routed if s != self._own_stream], room - len(pulled))
        return pulled

    async def _steal(self, streams: list[str], room: int) -> list[Pulled]:
        """The unread entries of other engines' routed streams whose oldest unread one waited
        ``steal_after_s``: that engine is busy (or dead), this one has room."""
        pulled: list[Pulled] = []
        now_ms = time.time() * 1000
        for stream in streams:
            if len(pulled) >= room:
                break
            if not await self._waited_too_long(stream, now_ms):
                continue
            entries = await self._client.xreadgroup(GROUP, self._consumer, {stream: ">"}, count=room - len(pulled))
            taken = await self._claims.claim(stream_entries(entries), mine_ok=False)
            log.info("took %d requests routed to another engine from %s", len(taken), stream)
            pulled += taken
        return pulled

    async def _waited_too_long(self, stream: str, now_ms: float) -> bool:
        try:
            groups = await self._client.xinfo_groups(stream)
        except ResponseError:
            return False  # no such stream
        group = next((g for g in groups if g["name"] == GROUP.encode()), None)
        if group is None or not group.get("lag"):
            return False  # nothing unread (or, lag unknown, nothing cheap to tell)
        oldest = await self._client.xrange(stream, min=b"(" + group["last-delivered-id"], max="+", count=1)
        return bool(oldest) and now_ms - int(oldest[0][0].split(b"-")[0]) >= self._steal_after_ms

    async def _dead_consumers(self, stream: str) -> list[tuple[str, int]]:
        """(name, pending count) of each consumer whose engine's heartbeat is gone or names another incarnation."""
        try:
            infos = await self._client.xinfo_consumers(stream, GROUP)
        except ResponseError:
            return []  # a routed stream not created yet, or its group (Redis restarted empty)
        consumers = [(c["name"].decode(), c["pending"]) for c in infos]
        others = [(name, pending) for name, pending in consumers if name != self._consumer]
        if not others:
            return []
        owners = [split_consumer(name) for name, _ in others]
        beats = await get_many(self._client, [self._keys.engine(engine_id) for engine_id, _ in owners])
        return [c for c, (_, incarnation), beat in zip(others, owners, beats) if not alive(beat, incarnation)]

    async def _claim_from(self, stream: str, consumer: str, count: int) -> list[Pulled]:
        pending = await self._client.xpending_range(stream, GROUP, min="-", max="+", count=count,
                                                    consumername=consumer, idle=self._heartbeat_ttl_ms)
        if not pending:
            return []
        deliveries = {p["message_id"]: p["times_delivered"] for p in pending}
        claimed = await self._client.xclaim(stream, GROUP, self._consumer, self._heartbeat_ttl_ms, list(deliveries))
        pulled = [read_request(e, f.get(b"p", b""), stream) for e, f in claimed if f]
        for p in pulled:
            p.deliveries = deliveries.get(p.handle.entry_id, 1)
        self._claims.adopt(pulled)
        await self._claims.take_over([p for p in pulled if p.msg is not None])
        log.info("claimed %d requests of dead consumer %s", len(pulled), consumer)
        return pulled
