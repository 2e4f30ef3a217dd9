"""The broker inside one process, for unit tests of the worker and the gateway without Redis.

A ``MemoryBus`` holds what Redis would: the request queue, the aborts, the
heartbeats (with their expiry) and the gateways waiting for replies. Messages
cross it encoded, as they cross Redis, and it keeps the rules listed in
``service.broker_api``; replies go straight to the subscribed gateway instead of
being stored for replay.
"""
from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import defaultdict, deque

from service.broker_api import (KV_WANTED_S, BeatResult, Pulled, Reply, RequestHandle, Resumed, read_request,
                                rows_by_gateway)
from service.config import GatewayConfig
from service.limits import MemoryLimiter
from service.messages import (ROW_FINISHED, GatewayBeat, Heartbeat, Progress, ReplyEvent, RequestMsg, StreamRecord,
                              encode, pack_batch)
from service.reply_router import ReplyRouter
from service.response_store import MemoryResponseStore
from service.supervise import supervised


class MemoryBus:
    """One deployment's shared state: what the Redis keys hold."""

    def __init__(self) -> None:
        # per served model, as the request streams: (entry id, RequestMsg) not pulled yet
        self.queued: defaultdict[str, deque[tuple[bytes, bytes]]] = defaultdict(deque)
        self.unacked: dict[bytes, bytes] = {}  # pulled, not finished
        self.aborts: list[str] = []
        self.beats: dict[str, tuple[bytes, float]] = {}  # engine id -> (Heartbeat, monotonic expiry)
        self.gateways: dict[str, MemoryGatewayBroker] = {}  # the live ones
        self.progress: dict[str, bytes] = {}  # request id -> Progress
        self.deadletter: list[tuple[str, str]] = []  # (request id, reason)
        self.kv_wanted: dict[str, float] = {}  # engine id -> monotonic expiry
        self.kv_snapshots: dict[str, tuple[bytes, float]] = {}  # engine id -> (KVSnapshotMsg, monotonic expiry)
        self.arrived: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.limiter: MemoryLimiter | None = None  # the gateways' shared per-key limits, made by the first
        self.responses = MemoryResponseStore()
        self._entry_ids = itertools.count(1)

    def enqueue(self, model: str, payload: bytes) -> None:
        self.queued[model].append((str(next(self._entry_ids)).encode(), payload))
        self.arrived[model].set()

    def pull(self, model: str, count: int) -> list[tuple[bytes, bytes]]:
        queued = self.queued[model]
        taken = [queued.popleft() for _ in range(min(count, len(queued)))]
        self.unacked.update(taken)
        if not queued:
            self.arrived[model].clear()
        return taken

    def live_beats(self) -> dict[str, bytes]:
        now = time.monotonic()
        for engine_id in [i for i, (_, expiry) in self.beats.items() if expiry <= now]:
            del self.beats[engine_id]
        return {i: beat for i, (beat, _) in self.beats.items()}


class MemoryGatewayBroker(ReplyRouter):
    """Replies arrive as Redis would carry them, one encoded ReplyBatch per engine step (``receive``);
    nothing is stored for replay, so a client cannot resume here."""

    def __init__(self, bus: MemoryBus, config: GatewayConfig) -> None:
        super().__init__(config)
        self.bus = bus
        self.gateway_id = uuid.uuid4().hex[:12]
        self._watcher: asyncio.Task | None = None

    def responses(self) -> MemoryResponseStore:
        return self.bus.responses

    def limiter(self, lease_s: float) -> MemoryLimiter:
        if self.bus.limiter is None:
            self.bus.limiter = MemoryLimiter(lease_s)
        return self.bus.limiter

    async def start(self) -> None:
        self.bus.gateways[self.gateway_id] = self
        await self._refresh_engines()
        self._watcher = supervised("engine-watch", self._watch, self.poll_s)

    async def close(self) -> None:
        await self._stop(self._watcher, self.poll_s + 1)
        await self._stop_background()
        self.bus.gateways.pop(self.gateway_id, None)

    async def submit(self, msg: RequestMsg, record: StreamRecord | None = None) -> asyncio.Queue[ReplyEvent]:
        """(The record is for resuming, which this transport cannot.)"""
        payload = encode(msg)  # first: a message that cannot be encoded leaves nothing pending
        queue = self._open(msg.request_id)
        self.bus.enqueue(msg.model, payload)
        return queue

    async def abort(self, request_id: str) -> None:
        self.release(request_id)
        self.bus.aborts.append(request_id)

    async def resume(self, request_id: str, tenant: str) -> Resumed | None:
        return None

    def receive(self, payload: bytes) -> None:
        """One engine step's ReplyBatch for this gateway."""
        self.route_payload(payload)

    async def _read_beats(self) -> dict[str, bytes] | None:
        return self.bus.live_beats()

    async def kv_snapshot(self, engine_id: str) -> bytes | None:
        now = time.monotonic()
        self.bus.kv_wanted[engine_id] = now + KV_WANTED_S
        payload, expiry = self.bus.kv_snapshots.get(engine_id, (None, 0.0))
        return payload if expiry > now else None


class MemoryWorkerBroker:
    """A worker's side; no engine dies in one process, so there is nothing to reclaim."""

    def __init__(self, bus: MemoryBus, engine_id: str, model: str, heartbeat_ttl_s: float,
                 block_s: float = 0.1) -> None:
        self.bus = bus
        self.engine_id = engine_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.model = model
        self._heartbeat_ttl_s = heartbeat_ttl_s
        self._block_s = block_s
        self._abort_cursor = 0  # every abort so far counts: its request may still be queued

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self.bus.beats.pop(self.engine_id, None)

    async def poll(self, count: int, block: bool) -> tuple[list[Pulled], list[str]]:
        """Up to ``count`` new requests (waiting up to ``block_s`` for one if ``block``) and new aborts."""
        if block and count and not self.bus.queued[self.model]:
            try:
                await asyncio.wait_for(self.bus.arrived[self.model].wait(), self._block_s)
            except asyncio.TimeoutError:
                pass
        pulled = [read_request(entry_id, payload) for entry_id, payload in self.bus.pull(self.model, count)]
        aborts = self.bus.aborts[self._abort_cursor:]
        self._abort_cursor += len(aborts)
        return pulled, aborts

    async def publish(self, items: list[Reply], checkpoints: list[Progress]) -> None:
        """One encoded ReplyBatch per gateway, as over Redis."""
        for handle, row in items:
            if row[ROW_FINISHED]:
                self.bus.unacked.pop(handle.entry_id, None)
        for gateway_id, rows in rows_by_gateway(items).items():
            if (gateway := self.bus.gateways.get(gateway_id)) is not None:
                gateway.receive(pack_batch(self.engine_id, self.incarnation, rows))
        self.bus.progress.update((p.request_id, encode(p)) for p in checkpoints)

    async def ack(self, handle: RequestHandle) -> None:
        self.bus.unacked.pop(handle.entry_id, None)

    async def dead_letter(self, handle: RequestHandle, reason: str) -> None:
        self.bus.deadletter.append((handle.request_id, reason))

    async def reclaim(self, room: int) -> list[Pulled]:
        return []

    async def taken_over(self, handles: list[RequestHandle]) -> list[RequestHandle]:
        return []

    async def gateways(self) -> dict[str, GatewayBeat]:
        return {gateway_id: GatewayBeat(gateway_id) for gateway_id in self.bus.gateways}

    async def heartbeat(self, beat: Heartbeat, prefixes: set[bytes] = frozenset()) -> BeatResult:
        """One engine, so no routing by prefixes; the bus never loses its state."""
        self.bus.beats[self.engine_id] = (encode(beat), time.monotonic() + self._heartbeat_ttl_s)
        return BeatResult(kv_wanted=self.bus.kv_wanted.get(self.engine_id, 0.0) > time.monotonic())

    async def publish_kv_snapshot(self, payload: bytes, ttl_s: float) -> None:
        self.bus.kv_snapshots[self.engine_id] = (payload, time.monotonic() + ttl_s)
