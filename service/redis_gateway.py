"""A gateway's side of the Redis broker (key layout in ``service.redis_keys``): submissions batched into
pipelines, one blocking reader over this gateway's out stream (and one over each out stream of the gateways
whose requests clients resumed here: in a Redis Cluster two streams may lie in different slots, which one
XREAD cannot name together), the engines' heartbeats read and this gateway's own written, and the replay
of a request's replies for an SSE resume.

Redis restarted without persistence loses the queue and every record, not the requests: this gateway
keeps what it submitted while the request lives. When its beat finds its own key gone, it writes its
StreamRecords again (SET NX) and, one beat later (time for the engines to re-assert the requests they
run), re-submits those no engine has accepted: a request an engine still owns is dropped as a
duplicate there, one whose entry was lost is queued again. The accepted ones have no queue entry left
for another engine to claim should theirs die: if one does, the request is queued again marked as a
resume (``RESUMES``), and the engine that takes it continues from the transcript. A failover to a replica
that lacked the last writes starts the same recovery: the beat finds another server behind the client."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import dataclass

from redis.asyncio.client import Pipeline

from service.broker import BROKER_ERRORS, COMMAND_TIMEOUT_S, UNFINISHED_TTL_S, connect, get_many, server_identity
from service.broker_api import KV_WANTED_S, Resumed
from service.config import GatewayConfig
from service.errors import BrokerUnavailable
from service.limits import RedisLimiter
from service.messages import GatewayBeat, RequestMsg, ReplyEvent, StreamRecord, decode_or_none, encode
from service.prefix_router import PrefixRouter
from service.redis_keys import RESUMES, Keys, split_consumer
from service.reply_readers import ReplyReaders
from service.reply_router import ReplyRouter
from service.response_store import RedisResponseStore
from service.supervise import supervised
from service.transcript import read_transcript

log = logging.getLogger(__name__)

_ABORTS_MAXLEN = 10_000
_MAX_SUBMIT_BATCH = 256  # submissions per pipeline
_COMMAND_RETRIES = 2  # a command may run 3 times: each is idempotent, or harmless twice (see start)


@dataclass(slots=True)
class _Submit:
    msg: RequestMsg
    record: bytes  # the StreamRecord, encoded
    payload: bytes  # the RequestMsg, encoded
    done: asyncio.Future[None]  # set once the pipeline that queued it ran


class RedisGatewayBroker(ReplyRouter):
    def __init__(self, config: GatewayConfig) -> None:
        super().__init__(config)
        self.gateway_id = uuid.uuid4().hex[:12]
        self._keys = Keys(config.redis.prefix)
        self._out = self._keys.out(self.gateway_id)
        self._readers = ReplyReaders(config.redis, self.poll_s, self._closing, self.route_payload)
        self._adopted: dict[str, str] = {}  # request id -> the gateway whose out stream carries it
        self._submits: list[_Submit] = []
        self._submitted: dict[str, _Submit] = {}  # request id -> its submission, while it lives here
        self._restore_due = False  # this gateway's beat key was gone: Redis may have lost its records
        self._resubmit: list[str] = []  # not accepted when Redis lost its state: queued again at the next beat
        self._entry_lost: set[str] = set()  # accepted when Redis lost its state: no queue entry left
        self._restored_at = 0.0  # monotonic: when this gateway last found Redis's state lost
        self._server: frozenset[str] | None = None  # the run ids behind the client at the last beat
        self._flusher: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._router = PrefixRouter(self._keys, config)

    def limiter(self, lease_s: float) -> RedisLimiter:
        """Per-key limits in this deployment's Redis (once started)."""
        return RedisLimiter(self._client, self._keys.prefix, lease_s)

    def responses(self) -> RedisResponseStore:
        return RedisResponseStore(self._client, self._keys)

    async def start(self) -> None:
        # Submissions may be retried: the StreamRecord is SET NX and a worker runs a request id once
        # (owner SET NX), so a retried XADD is harmless.
        self._client = connect(self.config.redis, retries=_COMMAND_RETRIES)
        self._readers.start(self._client)
        await self._readers.follow(self._out, "reply-reader")
        await self._refresh_engines()
        self._watcher = supervised("engine-watch", self._watch, self.poll_s)

    async def close(self) -> None:
        # The readers' blocking XREADs are woken, not cancelled: a read cancelled mid-flight can leave
        # redis-py's connection teardown waiting forever.
        await self._stop(self._watcher, self.poll_s + COMMAND_TIMEOUT_S)
        await self._stop_background()
        await self._readers.wake(self._out)
        for task in list(self._readers.tasks.values()):  # the others' reads return within the block time
            await self._stop(task, self.config.redis.block_ms / 1000 + COMMAND_TIMEOUT_S)
        try:
            await self._client.delete(self._keys.gateway(self.gateway_id))
            await self._client.srem(self._keys.gateways, self.gateway_id)
        except BROKER_ERRORS:
            pass
        await self._client.aclose()
        await self._readers.close()

    # ---- submit -----------------------------------------------------------
    async def submit(self, msg: RequestMsg, record: StreamRecord) -> asyncio.Queue[ReplyEvent]:
        item = _Submit(msg=msg, record=encode(record), payload=encode(msg),
                       done=asyncio.get_running_loop().create_future())
        queue = self._open(msg.request_id)  # before the XADD: the first replies may come at once
        self._submits.append(item)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_submits())
        try:
            await asyncio.shield(item.done)
        except asyncio.CancelledError:  # the client left; the entry may be queued all the same
            item.done.add_done_callback(lambda done: done.cancelled() or done.exception())  # seen: no warning
            self.abort_later(msg.request_id)
            raise
        except BrokerUnavailable:
            self.release(msg.request_id)
            raise
        if msg.request_id in self._subs:  # not ended while it was being queued
            self._submitted[msg.request_id] = item
        return queue

    async def _flush_submits(self) -> None:
        """One pipeline for every submission waiting (the ones that arrive meanwhile go in the next):
        a burst costs a few round trips and one connection, never a connection each."""
        while self._submits:
            batch, self._submits = self._submits[:_MAX_SUBMIT_BATCH], self._submits[_MAX_SUBMIT_BATCH:]
            routes = await self._router.routes(self._client, [item.msg for item in batch], self.engines)
            pipe = self._client.pipeline(transaction=False)
            for item, engine_id in zip(batch, routes):
                self._queue(pipe, item, engine_id)
            try:
                await pipe.execute()
                error = None
            except BROKER_ERRORS as exc:
                error = BrokerUnavailable(f"cannot reach Redis: {type(exc).__name__}")
            for item in batch:
                if error is None:
                    item.done.set_result(None)
                else:
                    item.done.set_exception(error)

    def _queue(self, pipe: Pipeline, item: _Submit, engine_id: str | None = None) -> None:
        """On the shared stream, or (``engine_id``) the stream of the engine it is routed to."""
        self._write_record(pipe, item)
        model = item.msg.model
        if engine_id is None:
            pipe.xadd(self._keys.requests(model), {"p": item.payload})
            return
        pipe.sadd(self._keys.routed_engines(model), engine_id)  # where reclaim and stealing look
        pipe.xadd(self._keys.routed(model, engine_id), {"p": item.payload})
        self._router.routed(item.msg.request_id, engine_id)

    def on_accepted(self, request_id: str, engine_id: str) -> None:
        self._router.accepted(request_id, engine_id, self.engines.get(engine_id))

    def _write_record(self, pipe: Pipeline, item: _Submit) -> None:
        """The StreamRecord, unless one is there (SET NX): the reply of the SET says whether it was missing."""
        pipe.set(self._keys.request(item.msg.request_id), item.record, ex=UNFINISHED_TTL_S, nx=True)

    # ---- abort ------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        self.release(request_id)
        try:
            await self._client.xadd(self._keys.aborts, {"r": request_id}, maxlen=_ABORTS_MAXLEN, approximate=True)
        except BROKER_ERRORS as exc:  # the workers' orphan rule still ends it once this gateway is gone
            log.warning("could not publish the abort of %s: %s", request_id, type(exc).__name__)

    def detach(self, request_id: str) -> None:
        """The client of a running stream hung up: it may resume (here or on another gateway) within
        the reconnect grace; otherwise the request is aborted and its record dropped (a later resume
        gets 404, not a stream that never moves)."""
        self.release(request_id)
        self._spawn(self._abort_after(request_id, self.config.reconnect_grace_s))

    async def _abort_after(self, request_id: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if request_id in self._subs or await self._adopted_elsewhere(request_id):
            return  # resumed here, or elsewhere
        try:
            await self._client.delete(self._keys.request(request_id))
        except BROKER_ERRORS:
            pass
        await self.abort(request_id)

    async def _adopted_elsewhere(self, request_id: str) -> bool:
        try:
            # Not this gateway's own beat: it may still list a request released since.
            ids = [i for m in await self._client.smembers(self._keys.gateways) if (i := m.decode()) != self.gateway_id]
            beats = await get_many(self._client, [self._keys.gateway(i) for i in ids])
            if gone := [i for i, b in zip(ids, beats) if b is None]:
                await self._client.srem(self._keys.gateways, *gone)
        except BROKER_ERRORS:
            return False
        return _adopted_anywhere(request_id, beats)

    # ---- resume -----------------------------------------------------------
    async def resume(self, request_id: str, tenant: str) -> Resumed | None:
        """The request's StreamRecord and a queue that gets every counted event from index 0 (the
        transcript's, then live ones); None when the record is missing (unknown or expired) or is another
        tenant's, found before anything here changes."""
        try:
            # One slot in a Cluster: both keys carry the request id as their hash tag.
            raw, owner = await self._client.mget([self._keys.request(request_id), self._keys.owner(request_id)])
        except BROKER_ERRORS as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {type(exc).__name__}") from exc
        record = decode_or_none(StreamRecord, raw)  # another release's record: resumable by that release only
        if record is None or not hmac.compare_digest(record.tenant.encode(), tenant.encode()):
            return None
        self.hand_over(request_id)  # a client resuming twice on this gateway: the newer wins
        queue = self._open(request_id, _owner(owner), held=True)
        try:
            await self._follow(request_id, record.gateway_id)
            transcript = await read_transcript(self._client, self._keys, record, from_checkpoint=False)
        except BROKER_ERRORS as exc:
            self.release(request_id)
            raise BrokerUnavailable(f"cannot reach Redis: {type(exc).__name__}") from exc
        self.replay(request_id, transcript.events)
        if transcript.hole_before is not None and (sub := self._subs.get(request_id)) is not None:
            # Without it the stream would wait for events that never come (a request that finished).
            self._end(request_id, sub, f"lost reply events {sub.expected}..{transcript.hole_before - 1}", 500)
        return Resumed(record, queue)

    async def _follow(self, request_id: str, gateway_id: str) -> None:
        """Reads ``gateway_id``'s out stream from now on (the transcript covers what came before)."""
        if gateway_id == self.gateway_id:
            return
        self._adopted[request_id] = gateway_id
        await self._readers.follow(self._keys.out(gateway_id), f"reply-reader {gateway_id}")

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._submitted.pop(request_id, None)
        self._router.forget(request_id)
        self._entry_lost.discard(request_id)
        gateway_id = self._adopted.pop(request_id, None)
        if gateway_id is not None and gateway_id not in self._adopted.values():
            self._readers.unfollow(self._keys.out(gateway_id))

    async def kv_snapshot(self, engine_id: str) -> bytes | None:
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._keys.kv_wanted(engine_id), b"1", px=int(KV_WANTED_S * 1000))
        pipe.get(self._keys.kv_snapshot(engine_id))
        try:
            _, payload = await pipe.execute()
        except BROKER_ERRORS as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {type(exc).__name__}") from exc
        return payload

    # ---- heartbeats -------------------------------------------------------
    async def _read_beats(self) -> dict[str, bytes] | None:
        await self._beat()
        try:
            ids = sorted(i.decode() for i in await self._client.smembers(self._keys.engines))
            beats = await get_many(self._client, [self._keys.engine(i) for i in ids])
            dead = [i for i, b in zip(ids, beats) if b is None]
            if dead:
                await self._client.srem(self._keys.engines, *dead)
        except BROKER_ERRORS as exc:
            log.debug("heartbeat read failed: %s", type(exc).__name__)
            return None
        return {i: b for i, b in zip(ids, beats) if b is not None}

    async def _beat(self) -> None:
        """This gateway is alive, and serves the requests it adopted: engines keep them running. Its key
        found gone (Redis restarted empty, or it expired) starts the recovery of the requests it submitted."""
        beat = GatewayBeat(self.gateway_id, sorted(self._adopted))
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.set(self._keys.gateway(self.gateway_id), encode(beat), px=int(self.config.gateway_ttl_s * 1000),
                     get=True)
            pipe.sadd(self._keys.gateways, self.gateway_id)
            previous, _ = await pipe.execute()
            await self._requeue()
            await self._requeue_orphans()
            self._restore_due |= previous is None or await self._failed_over()
            if self._restore_due:
                await self._restore()
        except BROKER_ERRORS as exc:
            log.debug("gateway heartbeat failed: %s", type(exc).__name__)

    async def _failed_over(self) -> bool:
        """Whether another server answers than at the last beat (a promoted replica, a restart): the last
        writes may be gone, and the out streams are read again from a little earlier."""
        server = await server_identity(self._client)
        changed = None not in (server, self._server) and server != self._server
        self._server = server or self._server
        if changed:
            log.warning("Redis is another server now (a failover or a restart): restoring this gateway's records")
            self._readers.rewind()
        return changed

    async def _restore(self) -> None:
        """Writes the live requests' StreamRecords again (SET NX); of those that were lost, the ones no
        engine accepted are queued again at the next beat, once the engines that run them had a beat's
        time to re-assert them."""
        pipe = self._client.pipeline(transaction=False)
        for item in self._submitted.values():
            self._write_record(pipe, item)
        # A record written again was lost with its queue entry (an expiry of this gateway's beat alone,
        # in a stall, loses neither).
        written = await pipe.execute() if self._submitted else []
        lost = {rid for rid, again in zip(self._submitted, written) if again}
        if lost:  # the out streams are new too
            self._readers.reread()
        self._resubmit = [item.msg.request_id for item in self._unaccepted(list(lost))]
        self._entry_lost |= lost - set(self._resubmit)
        self._restore_due, self._restored_at = False, time.monotonic()

    async def _requeue(self) -> None:
        if items := self._unaccepted(self._resubmit):
            pipe = self._client.pipeline(transaction=False)
            for item in items:
                self._queue(pipe, item)
            await pipe.execute()
            log.warning("Redis lost its state: queued %d requests again", len(items))
        self._resubmit = []

    async def _requeue_orphans(self) -> None:
        """Queues again, marked as a resume, each request of ``_entry_lost`` whose engine has been gone for a
        third of the resume deadline, counted from the loss at the earliest (a live engine beats again well
        within that). Only when its transcript is whole: a checkpoint written since the loss, or nothing
        delivered before."""
        since = time.monotonic() - self.config.resume_deadline_s / 3
        due = [rid for rid in self._entry_lost if (sub := self._subs.get(rid)) is not None
               and sub.lost_since is not None and max(sub.lost_since, self._restored_at) <= since]
        if not due:
            return
        checkpoints = await get_many(self._client, [self._keys.progress(rid) for rid in due])
        whole = [self._submitted[rid] for rid, checkpoint in zip(due, checkpoints)
                 if checkpoint is not None or self._subs[rid].expected == 0]
        pipe = self._client.pipeline(transaction=False)
        for item in whole:
            pipe.xadd(self._keys.requests(item.msg.model), {"p": item.payload, RESUMES: b""})
        await pipe.execute()
        self._entry_lost -= set(due)
        log.warning("%d requests lost their engine after Redis lost its state: %d queued again to resume, "
                    "%d without a checkpoint fail at the resume deadline", len(due), len(whole), len(due) - len(whole))

    def _unaccepted(self, request_ids: list[str]) -> list[_Submit]:
        """The submissions of these requests that are still live here and that no engine has accepted."""
        return [item for rid in request_ids
                if (item := self._submitted.get(rid)) and (sub := self._subs.get(rid)) and sub.owner is None]


def _owner(consumer: bytes | None) -> tuple[str, str] | None:
    return split_consumer(consumer.decode()) if consumer else None


def _adopted_anywhere(request_id: str, beats: list[bytes | None]) -> bool:
    """Whether a live gateway's beat lists ``request_id`` as adopted (its client resumed there)."""
    return any(beat is not None and request_id in beat.adopted
               for beat in (decode_or_none(GatewayBeat, payload) for payload in beats))
