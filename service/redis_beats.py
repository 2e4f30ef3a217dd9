"""A Redis engine's presence: its heartbeat, with the changes to the set of its cached block hashes (their
first 8 bytes; the whole set again after the beat key was found gone), expiring with the beat; the live
gateways' beats; its KV snapshot.

Redis restarted empty (no persistence): the next heartbeat finds this engine's beat key gone and says so
(``BeatResult.state_lost``), as it does when another server answers (a failover: the promoted replica may
lack the last writes).
"""
from __future__ import annotations

import logging

import redis.asyncio as aioredis

from service.broker import get_many, server_identity
from service.broker_api import BeatResult
from service.messages import GatewayBeat, Heartbeat, SchemaError, decode, encode
from service.redis_keys import PREFIX_KEY_BYTES, Keys

log = logging.getLogger(__name__)

_SET_CHUNK = 4096  # members per SADD / SREM


class Beats:
    def __init__(self, client: aioredis.Redis, keys: Keys, engine_id: str, heartbeat_ttl_ms: int) -> None:
        self._client = client
        self._keys = keys
        self._engine_id = engine_id
        self._heartbeat_ttl_ms = heartbeat_ttl_ms
        self._published_prefixes: set[bytes] | None = None  # as the set in Redis holds them; None: unknown
        self._server: frozenset[str] | None = None  # the run ids of the server(s) the last beat reached

    async def beat(self, beat: Heartbeat, prefixes: set[bytes]) -> BeatResult:
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._keys.engine(self._engine_id), encode(beat), px=self._heartbeat_ttl_ms, get=True)
        pipe.sadd(self._keys.engines, self._engine_id)
        pipe.exists(self._keys.kv_wanted(self._engine_id))
        published = self._queue_prefixes(pipe, {h[:PREFIX_KEY_BYTES] for h in prefixes})
        self._published_prefixes = None  # unknown until the pipeline's answer
        previous, _, wanted, *_ = await pipe.execute()
        # After the beat: one that landed on the old primary is followed by a look at the new one.
        server = await server_identity(self._client)
        server_changed = None not in (server, self._server) and server != self._server
        self._server = server or self._server
        if server_changed:  # its replica lacked the last writes, perhaps: as if Redis restarted
            log.warning("Redis is another server now (a failover or a restart): re-asserting this engine's state")
        state_lost = previous is None or server_changed  # the first beat, an expiry, Redis restarted empty
        self._published_prefixes = None if state_lost else published
        return BeatResult(state_lost=state_lost, server_changed=server_changed, kv_wanted=bool(wanted))

    async def gateways(self) -> dict[str, GatewayBeat]:
        """The live gateways by id; an unreadable beat counts as alive (it beats), adopting nothing."""
        ids = sorted(i.decode() for i in await self._client.smembers(self._keys.gateways))
        beats = await get_many(self._client, [self._keys.gateway(i) for i in ids])
        return {i: _gateway_beat(i, b) for i, b in zip(ids, beats) if b is not None}

    async def publish_kv_snapshot(self, payload: bytes, ttl_s: float) -> None:
        await self._client.set(self._keys.kv_snapshot(self._engine_id), payload, px=int(ttl_s * 1000))

    async def stop(self) -> None:
        """The beat deleted: other engines resume this one's unfinished requests at once."""
        await self._client.delete(self._keys.engine(self._engine_id))
        await self._client.srem(self._keys.engines, self._engine_id)

    def _queue_prefixes(self, pipe: aioredis.client.Pipeline, current: set[bytes]) -> set[bytes]:
        """The commands that make the routing set ``current`` (only the changes when the set in Redis is known)."""
        key = self._keys.prefixes(self._engine_id)
        if self._published_prefixes is None:
            pipe.delete(key)
            added, removed = current, set()
        else:
            added, removed = current - self._published_prefixes, self._published_prefixes - current
        for command, members in ((pipe.sadd, list(added)), (pipe.srem, list(removed))):
            for start in range(0, len(members), _SET_CHUNK):
                command(key, *members[start:start + _SET_CHUNK])
        pipe.pexpire(key, self._heartbeat_ttl_ms)
        return current


def _gateway_beat(gateway_id: str, payload: bytes) -> GatewayBeat:
    try:
        return decode(GatewayBeat, payload)
    except SchemaError as exc:
        log.error("unreadable beat of gateway %s: %s", gateway_id, exc)
        return GatewayBeat(gateway_id)
