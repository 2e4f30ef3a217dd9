"""An engine worker's side of the Redis broker (schema v5; the key layout is in ``service.redis_keys``): the
``WorkerBroker`` the worker sees, over its parts.

- Pull (``service.redis_intake``): XREADGROUP as consumer ``engine_id/incarnation``, from the stream of
  requests routed to this engine (by their cached prefix, see ``service.routing``) and the model's shared
  stream; each entry's request is claimed with ``SET owner NX`` (``service.redis_claims``), so a duplicated
  entry (a retried XADD) is acked and dropped, never run twice. After a failed read, the consumer's own
  pending entries are read back (id "0"): a read that timed out after Redis delivered leaves nothing
  unprocessed.
- Publish (``service.redis_replies``): one ReplyBatch entry per gateway per call (its cost is O(gateways),
  not O(requests)), the Progress checkpoints after them in the same pipeline (a checkpoint never covers an
  event that did not land), and a finished request's entry acked and deleted.
- Step lane (``service.redis_lane``): the publish and the poll ride on the engine's step thread, around the
  step; where there is no lane (a Redis Cluster), or it is down, the worker calls ``publish`` and ``poll``.
- Reclaim and steal (``service.redis_reclaim``): the pending entries of dead consumers are taken over with
  XCLAIM and come back with their transcript; an engine with room takes the entries another engine's
  routed stream left unread for ``steal_after_s``.
- Beats (``service.redis_beats``): each heartbeat carries the changes to the set of this engine's cached
  block hashes, expiring with the beat; the live gateways are read from theirs.
- Redis restarted empty (no persistence): the next heartbeat finds this engine's beat key gone and says so
  (``BeatResult.state_lost``); the worker then re-asserts ownership of what it runs (``taken_over``: SET
  owner NX, so a request another engine claimed meanwhile is dropped here) and re-writes its checkpoints.
  The gateways re-submit what no engine had accepted; a re-submitted entry of a request re-owned here is a
  duplicate. A request whose engine died after the loss has no entry left to reclaim: its gateway queues it
  again marked ``RESUMES``, and the engine that pulls it takes it over (transcript and all) if the owner is
  dead, or drops it as a duplicate if the owner lives.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from service.broker import _unavailable_on_error, connect, ensure_group, is_cluster
from service.broker_api import BeatResult, Pulled, Reply, RequestHandle
from service.config import RedisConfig
from service.messages import GatewayBeat, Heartbeat, Progress
from service.redis_beats import Beats
from service.redis_claims import Claims, execute
from service.redis_intake import Intake
from service.redis_keys import Keys, consumer_name
from service.redis_lane import WorkerLane
from service.redis_reclaim import Reclaimer
from service.redis_replies import ReplyCommands
from service.step_lane import StepLane

log = logging.getLogger(__name__)

_DEADLETTER_MAXLEN = 10_000
_LANE_RETRY_S = 0.5
_START_WAIT_S = 60.0  # a restarting Redis is back within seconds; one still gone after this is an outage


class RedisWorkerBroker:
    """Pull requests, read aborts, publish replies and checkpoints, reclaim dead engines' requests, beat.
    Its parts exist once ``start`` has connected."""

    def __init__(self, config: RedisConfig, engine_id: str, model: str, reply_ttl_s: int,
                 heartbeat_ttl_s: float, steal_after_s: float = 1.0) -> None:
        self.config = config
        self.engine_id = engine_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.consumer = consumer_name(engine_id, self.incarnation)
        self.lane: WorkerLane | None = None  # None for a Redis Cluster: its commands go through the client
        self._keys = Keys(config.prefix)
        self._model = model
        self._requests = self._keys.requests(model)
        self._routed = self._keys.routed(model, engine_id)
        self._reply_ttl_s = reply_ttl_s
        self._heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self._steal_after_ms = int(steal_after_s * 1000)

    async def start(self) -> None:
        self._client, self._blocking = connect(self.config), connect(self.config, blocking=True)
        await self._wait_for_groups()
        keys, streams = self._keys, (self._routed, self._requests)  # what was routed here goes first
        self._claims = Claims(self._client, keys, self.consumer, self._requests)
        self._intake = Intake(self._client, self._blocking, keys, self.consumer, streams, self._claims,
                              self.config.block_ms)
        self._reclaimer = Reclaimer(self._client, keys, self._model, self.consumer, self._routed, self._claims,
                                    self._heartbeat_ttl_ms, self._steal_after_ms)
        self._replies = ReplyCommands(keys, self.engine_id, self.incarnation, self._reply_ttl_s, self._requests)
        self._beats = Beats(self._client, keys, self.engine_id, self._heartbeat_ttl_ms)
        # A Cluster has no lane: the lane is one connection, to one node. Its commands go through the cluster
        # client's pipelines instead, split by node.
        if not is_cluster(self._client):
            lane = StepLane(self.config, retry_s=_LANE_RETRY_S)
            self.lane = WorkerLane(lane, self._intake, self._claims, self._replies)

    async def close(self) -> None:
        """Drops the heartbeat: other engines resume this one's unfinished requests at once."""
        try:
            await self._beats.stop()
        except (aioredis.RedisError, OSError):
            pass
        await self._client.aclose()
        await self._blocking.aclose()
        if self.lane is not None:
            self.lane.close()

    async def _wait_for_groups(self) -> None:
        """Redis may be restarting as this engine starts (one fault took both down): the engine waits up
        to ``_START_WAIT_S`` for it, rather than exiting at once with an error."""
        deadline = time.monotonic() + _START_WAIT_S
        while True:
            try:
                return await self._ensure_groups()
            except (aioredis.RedisError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise
                log.warning("Redis is not reachable yet (%s); retrying", type(exc).__name__)
                await asyncio.sleep(_LANE_RETRY_S)

    async def _ensure_groups(self) -> None:
        for stream in (self._routed, self._requests):
            await ensure_group(self._client, stream)
        await self._client.sadd(self._keys.routed_engines(self._model), self.engine_id)

    @_unavailable_on_error
    async def poll(self, count: int, block: bool) -> tuple[list[Pulled], list[str]]:
        """Up to ``count`` new requests (waiting for one if ``block``) and new aborts."""
        try:
            return await self._intake.poll(count, block)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self._ensure_groups()  # Redis restarted empty
            return [], []
        except Exception:
            self._intake.reply_lost()
            raise

    @_unavailable_on_error
    async def publish(self, items: list[Reply], checkpoints: list[Progress]) -> None:
        """One ReplyBatch per gateway, then the checkpoints, then the finished requests' acks; all or
        nothing for the caller, which keeps the items and calls again on failure (duplicates of events
        whose first try landed are dropped by the gateway, by index)."""
        commands, finished = self._replies.publish(items, checkpoints)
        await execute(self._client, commands)
        self._claims.release(finished)

    @_unavailable_on_error
    async def ack(self, handle: RequestHandle) -> None:
        """Ends an entry that needs no reply: unreadable, or its request finished before."""
        await execute(self._client, self._replies.finish([handle]))
        self._claims.release([handle])

    @_unavailable_on_error
    async def dead_letter(self, handle: RequestHandle, reason: str) -> None:
        """Records a request given up on; its error event (published next) acks the entry."""
        await self._client.xadd(self._keys.deadletter, {"r": handle.request_id, "e": handle.entry_id, "why": reason},
                                maxlen=_DEADLETTER_MAXLEN, approximate=True)

    @_unavailable_on_error
    async def reclaim(self, room: int) -> list[Pulled]:
        return await self._reclaimer.reclaim(room)

    @_unavailable_on_error
    async def taken_over(self, handles: list[RequestHandle]) -> list[RequestHandle]:
        return await self._claims.taken_over(handles)

    @_unavailable_on_error
    async def gateways(self) -> dict[str, GatewayBeat]:
        return await self._beats.gateways()

    @_unavailable_on_error
    async def heartbeat(self, beat: Heartbeat, prefixes: set[bytes] = frozenset()) -> BeatResult:
        return await self._beats.beat(beat, prefixes)

    @_unavailable_on_error
    async def publish_kv_snapshot(self, payload: bytes, ttl_s: float) -> None:
        await self._beats.publish_kv_snapshot(payload, ttl_s)
