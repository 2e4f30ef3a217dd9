"""An engine worker's side of the Redis broker (schema v5; the key layout is in ``service.redis_keys``).

- Pull: XREADGROUP as consumer ``engine_id/incarnation``, from the stream of requests routed to this engine
  (by their cached prefix, see ``service.routing``) and the model's shared stream; each entry's request is claimed with
  ``SET owner NX``, so a duplicated entry (a retried XADD) is acked and dropped, never run twice.
  After a failed read, the consumer's own pending entries are read back (id "0"): a read that timed
  out after Redis delivered leaves nothing unprocessed.
- Publish: one ReplyBatch entry per gateway per call (its cost is O(gateways), not O(requests)),
  the Progress checkpoints after them in the same pipeline (a checkpoint never covers an event that
  did not land), and a finished request's entry acked and deleted.
- Reclaim: the pending entries of dead consumers (their engine's heartbeat is gone or names another
  incarnation) are taken over with XCLAIM (atomic: once claimed, a second claimer's min-idle fails)
  and come back with their transcript, so the worker resumes them where the dead engine stopped; in the
  shared stream and in every engine's routed stream.
- Steal: an engine with room takes the entries another engine's routed stream left unread for
  ``steal_after_s`` (that engine is busy, or dead): routing never strands a request.
- Prefixes: each heartbeat carries the changes to the set of this engine's cached block hashes (their first
  8 bytes; the whole set again after the beat key was found gone), expiring with the beat.
- Redis restarted empty (no persistence): the next heartbeat finds this engine's beat key gone and sets
  ``lost_state``; the worker then re-asserts ownership of what it runs (``taken_over``: SET owner NX, so a
  request another engine claimed meanwhile is dropped here) and re-writes its checkpoints. The gateways
  re-submit what no engine had accepted; a re-submitted entry of a request re-owned here is a duplicate.
  A request whose engine died after the loss has no entry left to reclaim: its gateway queues it again
  marked ``RESUMES``, and the engine that pulls it takes it over (transcript and all) if the owner is
  dead, or drops it as a duplicate if the owner lives.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from service.broker import (GROUP, UNFINISHED_TTL_S, _unavailable_on_error, connect, ensure_group, get_many,
                            is_cluster, server_identity)
from service.broker_api import BrokerUnavailable, Pulled, Reply, RequestHandle, read_request, rows_by_gateway
from service.config import RedisConfig
from service.messages import (ROW_FINISHED, GatewayBeat, Heartbeat, Progress, SchemaError, StreamRecord, decode, encode,
                              pack_batch)
from service.redis_keys import PREFIX_KEY_BYTES, RESUMES, Keys, consumer_name, split_consumer
from service.step_lane import Command, StepLane
from service.transcript import read_transcript

log = logging.getLogger(__name__)

_DEADLETTER_MAXLEN = 10_000
_LANE_RETRY_S = 0.5
_START_WAIT_S = 60.0  # a restarting Redis is back within seconds; one still gone after this is an outage
_SET_CHUNK = 4096  # members per SADD / SREM

Entry = tuple[str, bytes, dict]  # (stream, entry id, fields)


@dataclass(slots=True)
class LaneCall:
    """One exchange on the step lane: the publish's commands first, then the poll's (sent with them, or in an
    exchange of their own after the step: ``poll_after``)."""

    publish: int  # how many commands are the publish's
    pulls: bool  # the poll asked for new entries (XREADGROUP), before the aborts (XREAD)
    finished: list[RequestHandle]
    sent: bool
    poll_after: bool = False  # the poll waits for the step, in an exchange of its own
    replies: list | None = None  # None: the exchange failed
    fresh: list[Entry] = field(default_factory=list)  # the entries the poll delivered
    pulled: list[Pulled] = field(default_factory=list)  # read from them
    owners: list | None = None  # ``_own``'s replies for the readable ones; None: that exchange failed


class RedisWorkerBroker:
    """Pull requests, read aborts, publish replies and checkpoints, reclaim dead engines' requests, beat."""

    def __init__(self, config: RedisConfig, engine_id: str, model: str, reply_ttl_s: int,
                 heartbeat_ttl_s: float, steal_after_s: float = 1.0) -> None:
        self.config = config
        self.engine_id = engine_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.consumer = consumer_name(engine_id, self.incarnation)
        self._keys = Keys(config.prefix)
        self._model = model
        self._requests = self._keys.requests(model)
        self._routed = self._keys.routed(model, engine_id)
        self._streams = (self._routed, self._requests)  # what was routed here goes first
        self._steal_after_ms = int(steal_after_s * 1000)
        self._published_prefixes: set[bytes] | None = None  # as the set in Redis holds them; None: unknown
        self._reply_ttl_s = reply_ttl_s
        self._heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self._client: aioredis.Redis | None = None
        self._blocking: aioredis.Redis | None = None
        self._lane: StepLane | None = None
        self._abort_cursor = b"0-0"
        self._running: set[tuple[str, bytes]] = set()  # (stream, entry id) of the requests this consumer runs
        self._expire_due: dict[str, float] = {}  # gateway id -> when its out stream's TTL is renewed next
        self._recover = False  # a read failed: Redis may have delivered entries that never arrived
        # The beat key was gone (Redis restarted empty, or it expired in a stall): the owner keys of the
        # requests this engine runs may be gone or another engine's; ``taken_over`` settles it.
        self.lost_state = False
        self.kv_wanted = False
        self.server_changed = False  # the last beat reached another server than the one before (a failover)
        self._server: frozenset[str] | None = None

    async def start(self) -> None:
        self._client, self._blocking = connect(self.config), connect(self.config, blocking=True)
        # A Cluster has none: the lane is one connection, to one node. Its commands go through the cluster
        # client's pipelines instead, split by node.
        self._lane = None if is_cluster(self._client) else StepLane(self.config, retry_s=_LANE_RETRY_S)
        await self._wait_for_groups()
        # Aborts from the last minute still matter: their requests may be queued.
        self._abort_cursor = f"{int(time.time() * 1000) - 60_000}-0".encode()

    async def close(self) -> None:
        """Drops the heartbeat: other engines resume this one's unfinished requests at once."""
        try:
            await self._client.delete(self._keys.engine(self.engine_id))
            await self._client.srem(self._keys.engines, self.engine_id)
        except (aioredis.RedisError, OSError):
            pass
        await self._client.aclose()
        await self._blocking.aclose()
        if self._lane is not None:
            self._lane.close()

    @_unavailable_on_error
    async def poll(self, count: int, block: bool) -> tuple[list[Pulled], list[str]]:
        """Up to ``count`` new requests (waiting for one if ``block``) and new aborts."""
        try:
            return await self._poll(count, block)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self._ensure_groups()  # Redis restarted empty
            return [], []
        except Exception:
            self._recover = True
            raise

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
        for stream in self._streams:
            await ensure_group(self._client, stream)
        await self._client.sadd(self._keys.routed_engines(self._model), self.engine_id)

    async def _poll(self, count: int, block: bool) -> tuple[list[Pulled], list[str]]:
        recovered = await self._own_pending() if self._recover else []
        self._recover = False
        streams = {stream: ">" for stream in self._streams}
        if block and count:
            entries = await self._blocking.xreadgroup(GROUP, self.consumer, streams, count=count,
                                                      block=self.config.block_ms)
            aborts = await self._client.xread({self._keys.aborts: self._abort_cursor})
        else:
            pipe = self._client.pipeline(transaction=False)
            if count:
                pipe.xreadgroup(GROUP, self.consumer, streams, count=count)
            pipe.xread({self._keys.aborts: self._abort_cursor})
            results = await pipe.execute()
            entries, aborts = (results if count else ([], results[0]))
        pulled = (await self._claim(recovered, mine_ok=True)
                  + await self._claim(self._not_running(_entries(entries)), mine_ok=False))
        return pulled, self._read_aborts(aborts)

    def _not_running(self, entries: list[Entry]) -> list[Entry]:
        """The entries but those this consumer runs already: a replica promoted after the delivery of one,
        without it (replication is asynchronous), delivers it again."""
        return [(stream, e, f) for stream, e, f in entries if (stream, e) not in self._running]

    async def _own_pending(self) -> list[Entry]:
        """This consumer's pending entries it is not running (a read whose reply was lost). Listed with
        XPENDING and fetched with XRANGE: re-reading them with XREADGROUP would count a delivery each
        time, and a few link errors would dead-letter a healthy request."""
        found: list[Entry] = []
        for stream in self._streams:
            pending = await self._client.xpending_range(stream, GROUP, "-", "+", 1000, consumername=self.consumer)
            ids = [p["message_id"] for p in pending if (stream, p["message_id"]) not in self._running]
            if not ids:
                continue
            pipe = self._client.pipeline(transaction=False)
            for entry_id in ids:
                pipe.xrange(stream, entry_id, entry_id)
            found += [(stream, e, f) for entries in await pipe.execute() for e, f in entries if f]
        return found

    async def _claim(self, entries: list[Entry], mine_ok: bool) -> list[Pulled]:
        """Each request's owner key, set if absent (see ``_claimed``)."""
        pulled = _read_entries(entries)
        readable = [p for p in pulled if p.msg is not None]
        owners = await self._own([p.msg.request_id for p in readable]) if readable else []
        return await self._claimed(entries, pulled, owners, mine_ok)

    async def _claimed(self, entries: list[Entry], pulled: list[Pulled], owners: list[bytes | None],
                       mine_ok: bool) -> list[Pulled]:
        """``owners``: what each readable request's owner key held before ``_own``. One already set is a
        duplicate entry's (or, with ``mine_ok``, this consumer's own claim from a read whose reply was lost),
        unless the entry is a gateway's re-queue (field RESUMES) and that owner is dead: then the request is
        taken over."""
        readable = [p for p in pulled if p.msg is not None]
        if not readable:
            return pulled
        me = self.consumer.encode()
        requeued = {(stream, entry_id) for stream, entry_id, fields in entries if RESUMES.encode() in fields}
        orphans = await self._of_dead_owners([(p, old) for p, old in zip(readable, owners)
                                              if self._key(p.handle) in requeued and old != me])
        duplicates = {self._key(p.handle) for p, old in zip(readable, owners)
                      if old is not None and not (mine_ok and old == me)} - {self._key(p.handle) for p in orphans}
        await self._take_over(orphans)
        if duplicates:
            log.warning("dropping %d duplicated request entries", len(duplicates))
            await self._drop([p.handle for p in pulled if self._key(p.handle) in duplicates])
        kept = [p for p in pulled if self._key(p.handle) not in duplicates]
        self._running.update(self._key(p.handle) for p in kept if p.msg is not None)
        return kept

    async def _of_dead_owners(self, claimed: list[tuple[Pulled, bytes | None]]) -> list[Pulled]:
        """Those whose owner before (None: its key was lost too) is not a live engine's consumer."""
        owners = [split_consumer(old.decode()) if old else ("", "") for _, old in claimed]
        beats = await get_many(self._client, [self._keys.engine(engine_id) for engine_id, _ in owners])
        return [p for (p, _), (_, incarnation), beat in zip(claimed, owners, beats) if not _alive(beat, incarnation)]

    async def _own(self, request_ids: list[str]) -> list[bytes | None]:
        """Sets each request's owner key to this consumer where it is absent; the owners before."""
        pipe = self._client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.set(self._keys.owner(request_id), self.consumer, nx=True, get=True, ex=UNFINISHED_TTL_S)
        return await pipe.execute()

    def _own_commands(self, request_ids: list[str]) -> list[Command]:
        """``_own`` for the step lane, whose replies are raw (redis-py's SET callback needs its ``get``
        keyword to return the old value, so ``_own`` keeps the keyword form)."""
        return [("SET", self._keys.owner(rid), self.consumer, "NX", "GET", "EX", UNFINISHED_TTL_S)
                for rid in request_ids]

    async def _drop(self, handles: list[RequestHandle]) -> None:
        await self._execute(self._ack_commands(handles))

    def _read_aborts(self, response: list) -> list[str]:
        ids = []
        for _, entries in response or []:
            for entry_id, fields in entries:
                self._abort_cursor = entry_id
                ids.append(fields.get(b"r", b"").decode())
        return ids

    @_unavailable_on_error
    async def publish(self, items: list[Reply], checkpoints: list[Progress]) -> None:
        """One ReplyBatch per gateway, then the checkpoints, then the finished requests' acks; all or
        nothing for the caller, which keeps the items and calls again on failure (duplicates of events
        whose first try landed are dropped by the gateway, by index)."""
        commands, finished = self._publish_commands(items, checkpoints)
        await self._execute(commands)
        self._published(finished)

    def _publish_commands(self, items: list[Reply], checkpoints: list[Progress]) -> tuple[list[Command],
                                                                                          list[RequestHandle]]:
        """``publish``'s commands (for either client), and the finished requests among the items."""
        commands: list[Command] = []
        min_id = f"{int(time.time() * 1000) - self._reply_ttl_s * 1000}-0"
        now = time.monotonic()
        for gateway_id, rows in rows_by_gateway(items).items():
            out = self._keys.out(gateway_id)
            commands.append(("XADD", out, "MINID", "~", min_id, "*", "b",
                             pack_batch(self.engine_id, self.incarnation, rows)))
            if self._expire_due.get(gateway_id, 0.0) <= now:
                # Gone once nothing wrote to it for the retention window: renewed every second or so, not every step.
                commands.append(("EXPIRE", out, self._reply_ttl_s))
                self._expire_due[gateway_id] = now + min(1.0, self._reply_ttl_s / 4)
        for progress in checkpoints:
            commands.append(("SET", self._keys.progress(progress.request_id), encode(progress), "EX", UNFINISHED_TTL_S))
        finished = [handle for handle, row in items if row[ROW_FINISHED] and handle.entry_id]  # not a resend
        return commands + self._finish_commands(finished), finished

    def _published(self, finished: list[RequestHandle]) -> None:
        self._running.difference_update(self._key(h) for h in finished)

    def _finish_commands(self, handles: list[RequestHandle]) -> list[Command]:
        if not handles:
            return []
        commands: list[Command] = [("EXPIRE", key(handle.request_id), self._reply_ttl_s) for handle in handles
                                   if handle.request_id for key in (self._keys.request, self._keys.owner,
                                                                    self._keys.progress)]
        return commands + self._ack_commands(handles)

    def _key(self, handle: RequestHandle) -> tuple[str, bytes]:
        return handle.stream or self._requests, handle.entry_id

    def _ack_commands(self, handles: list[RequestHandle]) -> list[Command]:
        """Each handle's entry acked and deleted, in the stream it came from."""
        by_stream: defaultdict[str, list[bytes]] = defaultdict(list)
        for handle in handles:
            stream, entry_id = self._key(handle)
            by_stream[stream].append(entry_id)
        return [command for stream, ids in by_stream.items()
                for command in (("XACK", stream, GROUP, *ids), ("XDEL", stream, *ids))]

    async def _execute(self, commands: list[Command]) -> list:
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return await pipe.execute()

    # The step lane (service.step_lane): publish + poll on the engine's step thread, around a step.

    def lane_ready(self) -> bool:
        """The lane may carry the next step's exchange: it is connected (or due for a try) and no failed
        read left entries to recover (the asyncio ``poll`` does that)."""
        return self._lane is not None and not self._recover and self._lane.ready()

    def lane_send(self, items: list[Reply], checkpoints: list[Progress], count: int | None) -> LaneCall:
        """Step thread, before the step: ``publish``'s commands, then ``poll``'s (non-blocking) for up to
        ``count`` new entries. None: the poll waits for the step (``lane_receive``), so that what arrives
        during a long step joins the next one, not the one after (an exchange more per step)."""
        commands, finished = self._publish_commands(items, checkpoints)
        if count is None:
            return LaneCall(len(commands), False, finished, self._lane.send(commands), poll_after=True)
        return LaneCall(len(commands), bool(count), finished, self._lane.send(commands + self._poll_commands(count)))

    def _poll_commands(self, count: int) -> list[Command]:
        poll: list[Command] = [("XREADGROUP", "GROUP", GROUP, self.consumer, "COUNT", count, "STREAMS",
                                *self._streams, *(">",) * len(self._streams))] if count else []
        return poll + [("XREAD", "STREAMS", self._keys.aborts, self._abort_cursor)]

    def lane_receive(self, call: LaneCall, count: int) -> None:
        """Step thread, after the step: the replies; the poll for up to ``count`` entries if it waited for the
        step (``count`` as the step left room); new entries claimed (``_own``) in another exchange at once."""
        call.replies = self._lane.receive() if call.sent else None
        if call.replies is not None and call.poll_after:
            poll, call.pulls = self._poll_commands(count), bool(count)
            polled = self._lane.receive() if self._lane.send(poll) else None
            # Failed, the poll may still have delivered entries: its errors have ``lane_polled`` recover them.
            call.replies += polled or [ResponseError("the step lane's poll failed")] * len(poll)
        if not call.pulls or call.replies is None or isinstance(reply := call.replies[call.publish], ResponseError):
            return
        call.fresh = self._not_running(_entries(_stream_reply(reply)))
        call.pulled = _read_entries(call.fresh)
        ids = [p.msg.request_id for p in call.pulled if p.msg is not None]
        if ids and self._lane.send(self._own_commands(ids)):
            owners = self._lane.receive()
            call.owners = None if owners is None or any(isinstance(o, ResponseError) for o in owners) else owners
        elif not ids:
            call.owners = []

    def lane_published(self, call: LaneCall) -> None:
        """Raises BrokerUnavailable unless the whole publish landed (the caller keeps its items then)."""
        if call.replies is None or any(isinstance(r, ResponseError) for r in call.replies[:call.publish]):
            self._recover = True  # the poll's entries may have been delivered, their reply lost
            raise BrokerUnavailable("cannot reach Redis: the step lane's exchange failed")
        self._published(call.finished)

    @_unavailable_on_error
    async def lane_polled(self, call: LaneCall) -> tuple[list[Pulled], list[str]]:
        """The poll's part of a published call, as ``poll`` returns it. A command's error (say NOGROUP after
        Redis restarted empty) is left to the next ``poll``, which recovers."""
        replies = call.replies[call.publish:]
        # A failed claim may have landed: the entries stay pending here, and the next poll's recovery
        # claims them as this consumer's own.
        if any(isinstance(r, ResponseError) for r in replies) or (call.pulls and call.owners is None):
            self._recover = True
            return [], []
        try:
            pulled = await self._claimed(call.fresh, call.pulled, call.owners, mine_ok=False)
        except Exception:
            self._recover = True
            raise
        return pulled, self._read_aborts(_stream_reply(replies[-1]))

    @_unavailable_on_error
    async def ack(self, handle: RequestHandle) -> None:
        """Ends an entry that needs no reply: unreadable, or its request finished before."""
        await self._execute(self._finish_commands([handle]))
        self._running.discard(self._key(handle))

    @_unavailable_on_error
    async def dead_letter(self, handle: RequestHandle, reason: str) -> None:
        """Records a request given up on; its error event (published next) acks the entry."""
        await self._client.xadd(self._keys.deadletter, {"r": handle.request_id, "e": handle.entry_id, "why": reason},
                                maxlen=_DEADLETTER_MAXLEN, approximate=True)

    @_unavailable_on_error
    async def reclaim(self, room: int) -> list[Pulled]:
        """Up to ``room`` pending entries of dead consumers, claimed for this one, with their transcripts
        (``Pulled.resume``) and how many engines had them (``Pulled.deliveries``); then, with room left,
        entries other engines' routed streams left unread too long."""
        pulled: list[Pulled] = []
        engines = sorted(e.decode() for e in await self._client.smembers(self._keys.routed_engines(self._model)))
        routed = [self._keys.routed(self._model, engine_id) for engine_id in engines]
        for stream in [self._requests, *routed]:
            for name, pending in await self._dead_consumers(stream):
                if not pending:
                    await self._client.xgroup_delconsumer(stream, GROUP, name)
                elif len(pulled) < room:
                    pulled += await self._claim_from(stream, name, room - len(pulled))
        if len(pulled) < room:
            pulled += await self._steal([s for s in routed if s != self._routed], room - len(pulled))
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
            entries = await self._client.xreadgroup(GROUP, self.consumer, {stream: ">"}, count=room - len(pulled))
            taken = await self._claim(_entries(entries), mine_ok=False)
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
        others = [(name, pending) for name, pending in consumers if name != self.consumer]
        if not others:
            return []
        owners = [split_consumer(name) for name, _ in others]
        beats = await get_many(self._client, [self._keys.engine(engine_id) for engine_id, _ in owners])
        return [c for c, (_, incarnation), beat in zip(others, owners, beats) if not _alive(beat, incarnation)]

    async def _claim_from(self, stream: str, consumer: str, count: int) -> list[Pulled]:
        pending = await self._client.xpending_range(stream, GROUP, min="-", max="+", count=count,
                                                    consumername=consumer, idle=self._heartbeat_ttl_ms)
        if not pending:
            return []
        deliveries = {p["message_id"]: p["times_delivered"] for p in pending}
        claimed = await self._client.xclaim(stream, GROUP, self.consumer, self._heartbeat_ttl_ms, list(deliveries))
        pulled = [read_request(e, f.get(b"p", b""), stream) for e, f in claimed if f]
        for p in pulled:
            p.deliveries = deliveries.get(p.handle.entry_id, 1)
            self._running.add(self._key(p.handle))
        await self._take_over([p for p in pulled if p.msg is not None])
        log.info("claimed %d requests of dead consumer %s", len(pulled), consumer)
        return pulled

    async def _take_over(self, pulled: list[Pulled]) -> None:
        """Owner keys set to this consumer, and each request's transcript read: the engine resumes it."""
        if not pulled:
            return
        pipe = self._client.pipeline(transaction=False)
        for p in pulled:
            pipe.set(self._keys.owner(p.msg.request_id), self.consumer, ex=UNFINISHED_TTL_S)
        await pipe.execute()
        for p in pulled:
            p.resume = await read_transcript(self._client, self._keys, _record_of(p))

    @_unavailable_on_error
    async def taken_over(self, handles: list[RequestHandle]) -> list[RequestHandle]:
        """Those of these requests whose owner key names another consumer now: another engine resumed them
        while this one looked dead. A missing owner key (Redis restarted empty) is no other engine's claim:
        it is set again, so a re-submitted entry of the request is dropped as a duplicate, not run twice."""
        self.lost_state = False  # before the round trip: a beat that finds its key gone meanwhile sets it again
        try:
            owners = await self._own([h.request_id for h in handles]) if handles else []
        except BaseException:
            self.lost_state = True
            raise
        me = self.consumer.encode()
        lost = [h for h, owner in zip(handles, owners) if owner is not None and owner != me]
        self._running.difference_update(self._key(h) for h in lost)
        return lost

    @_unavailable_on_error
    async def gateways(self) -> dict[str, GatewayBeat]:
        """The live gateways by id; an unreadable beat counts as alive (it beats), adopting nothing."""
        ids = sorted(i.decode() for i in await self._client.smembers(self._keys.gateways))
        beats = await get_many(self._client, [self._keys.gateway(i) for i in ids])
        return {i: _gateway_beat(i, b) for i, b in zip(ids, beats) if b is not None}

    @_unavailable_on_error
    async def heartbeat(self, beat: Heartbeat, prefixes: set[bytes] = frozenset()) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._keys.engine(self.engine_id), encode(beat), px=self._heartbeat_ttl_ms, get=True)
        pipe.sadd(self._keys.engines, self.engine_id)
        pipe.exists(self._keys.kv_wanted(self.engine_id))
        published = self._queue_prefixes(pipe, {h[:PREFIX_KEY_BYTES] for h in prefixes})
        self._published_prefixes = None  # unknown until the pipeline's answer
        previous, _, wanted, *_ = await pipe.execute()
        # After the beat: one that landed on the old primary is followed by a look at the new one. Both
        # flags are set after the last await: the worker reads them as soon as this returns, and a
        # ``taken_over`` running meanwhile would clear ``lost_state`` before the worker saw it.
        server = await server_identity(self._client)
        self.server_changed = None not in (server, self._server) and server != self._server
        self._server = server or self._server
        self._published_prefixes = published
        self.kv_wanted = bool(wanted)
        if self.server_changed:  # its replica lacked the last writes, perhaps: as if Redis restarted
            log.warning("Redis is another server now (a failover or a restart): re-asserting this engine's state")
        if previous is None or self.server_changed:  # the first beat, an expiry, Redis restarted empty
            self.lost_state = True
            self._published_prefixes = None

    def _queue_prefixes(self, pipe: aioredis.client.Pipeline, current: set[bytes]) -> set[bytes]:
        """The commands that make the routing set ``current`` (only the changes when the set in Redis is known)."""
        key = self._keys.prefixes(self.engine_id)
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

    @_unavailable_on_error
    async def publish_kv_snapshot(self, payload: bytes, ttl_s: float) -> None:
        await self._client.set(self._keys.kv_snapshot(self.engine_id), payload, px=int(ttl_s * 1000))


def _read_entries(entries: list[Entry]) -> list[Pulled]:
    return [read_request(entry_id, fields.get(b"p", b""), stream) for stream, entry_id, fields in entries]


def _entries(reply: list | None) -> list[Entry]:
    """An XREADGROUP reply's entries, each with its stream."""
    return [(stream.decode(), e, f) for stream, entries in reply or [] for e, f in entries]


def _stream_reply(reply: list | None) -> list[tuple[bytes, list[tuple[bytes, dict]]]]:
    """A raw XREAD/XREADGROUP reply in redis-py's shape: per stream, (entry id, fields as a dict)."""
    return [(name, [(entry_id, dict(zip(flat[::2], flat[1::2])) if flat else {}) for entry_id, flat in entries])
            for name, entries in reply or []]


def _alive(beat: bytes | None, incarnation: str) -> bool:
    if beat is None:
        return False
    try:
        return decode(Heartbeat, beat).incarnation == incarnation
    except SchemaError:
        return True  # an engine of another release beats there: not ours to take over


def _gateway_beat(gateway_id: str, payload: bytes) -> GatewayBeat:
    try:
        return decode(GatewayBeat, payload)
    except SchemaError as exc:
        log.error("unreadable beat of gateway %s: %s", gateway_id, exc)
        return GatewayBeat(gateway_id)


def _record_of(pulled: Pulled) -> StreamRecord:
    """What ``read_transcript`` needs of the StreamRecord, from the request itself (it names the gateway
    and its arrival, the gateway's wall clock at submission): no GET, and no dependence on the record."""
    msg = pulled.msg
    return StreamRecord(msg.request_id, msg.gateway_id, b"", msg.prompt_token_ids, 0,
                        int(msg.arrival_time * 1000), "")
