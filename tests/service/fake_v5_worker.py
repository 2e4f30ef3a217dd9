"""A tiny engine worker on the v5 wire, for gateway tests: it takes requests, says ACCEPTED, then sends
one token per request per step ("A", "B", ... by position: the text of a run is known in advance), each
step's events as one ``encode_batch`` entry per gateway. Over Redis (``RedisTransport``) or the memory
bus (``MemoryTransport``)."""
from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass

from service.broker import GROUP, ensure_group
from service.memory_broker import MemoryBus
from service.messages import (ChoiceDelta, EventKind, Heartbeat, ReplyBatch, ReplyEvent, RequestMsg,
                              decode, encode, encode_batch)
from service.redis_keys import Keys, consumer_name
from tests.service.conftest import MODEL_NAME, engine_stats

ENGINE_ID, INCARNATION = "fake", "1"
BEAT_S = 0.25  # well within the beat's 5 s TTL


def token_id(index: int) -> int:
    """The token this worker sends at ``index``: 26 ids in turn."""
    return 65 + index % 26


def expected_text(max_tokens: int, tokenizer) -> str:
    """What a gateway makes of this worker's tokens (its tokenizer's text for them)."""
    return tokenizer.decode([token_id(i) for i in range(max_tokens)])


@dataclass(slots=True)
class _Running:
    max_tokens: int
    sent: int = 0


class MemoryTransport:
    def __init__(self, bus: MemoryBus) -> None:
        self.bus = bus
        self._abort_cursor = 0

    async def pull(self, count: int) -> list[RequestMsg]:
        return [decode(RequestMsg, payload) for _, payload in self.bus.pull(MODEL_NAME, count)]

    async def aborts(self) -> list[str]:
        new = self.bus.aborts[self._abort_cursor:]
        self._abort_cursor += len(new)
        return new

    async def publish(self, gateway_id: str, payload: bytes) -> None:
        if (gateway := self.bus.gateways.get(gateway_id)) is not None:
            gateway.receive(payload)

    async def beat(self, beat: Heartbeat) -> None:
        self.bus.beats[ENGINE_ID] = (encode(beat), float("inf"))


class RedisTransport:
    def __init__(self, client, prefix: str) -> None:
        self.client = client
        self.keys = Keys(prefix)
        self._requests = self.keys.requests(MODEL_NAME)
        self._abort_cursor = b"0-0"
        self._consumer = consumer_name(ENGINE_ID, INCARNATION)

    async def pull(self, count: int) -> list[RequestMsg]:
        await ensure_group(self.client, self._requests)
        response = await self.client.xreadgroup(GROUP, self._consumer, {self._requests: ">"}, count=count)
        entries = [entry for _, stream in response or [] for entry in stream]
        if not entries:
            return []
        msgs = [decode(RequestMsg, fields[b"p"]) for _, fields in entries]
        # One round trip for the whole pull, as a real worker's: a burst is not 2,000 sequential commands.
        pipe = self.client.pipeline(transaction=False)
        for msg in msgs:  # a duplicated entry (a retried XADD) runs once: the owner is claimed with SET NX
            pipe.set(self.keys.owner(msg.request_id), self._consumer, nx=True, ex=600)
        pipe.xack(self._requests, GROUP, *(entry_id for entry_id, _ in entries))
        *owned, _ = await pipe.execute()
        return [msg for msg, won in zip(msgs, owned) if won]

    async def aborts(self) -> list[str]:
        response = await self.client.xread({self.keys.aborts: self._abort_cursor})
        ids = []
        for _, entries in response or []:
            for entry_id, fields in entries:
                self._abort_cursor = entry_id
                ids.append(fields[b"r"].decode())
        return ids

    async def publish(self, gateway_id: str, payload: bytes) -> None:
        await self.client.xadd(self.keys.out(gateway_id), {"b": payload})

    async def beat(self, beat: Heartbeat) -> None:
        await self.client.set(self.keys.engine(ENGINE_ID), encode(beat), px=5_000)
        await self.client.sadd(self.keys.engines, ENGINE_ID)


class FakeV5Worker:
    def __init__(self, transport: MemoryTransport | RedisTransport, step_s: float = 0.005,
                 max_running: int = 2_000) -> None:
        self.transport = transport
        self.step_s = step_s
        self.max_running = max_running
        self.running: dict[str, _Running] = {}
        self.gateway_of: dict[str, str] = {}  # every request taken -> its gateway
        self.aborted: list[str] = []
        self.duplicate: list[tuple[str, ReplyEvent]] = []  # events to send once more, next step
        self.stopped = False

    def stop(self) -> None:
        """Ends ``run`` after its current step. Cancelling it instead can hang: a redis-py call cancelled
        mid-command may never return."""
        self.stopped = True

    async def run(self) -> None:
        """Steps until stopped. It beats from a task of its own, as a real worker does: a step slowed down
        by a busy event loop (a burst, a loaded machine) is not a dead engine. A failed step or beat ends both."""
        beats = asyncio.create_task(self._beat())
        try:
            while not self.stopped and not beats.done():
                await self.step()
                await asyncio.sleep(self.step_s)
        finally:
            self.stopped = True
            await beats  # its error, if it had one

    async def _beat(self) -> None:
        while not self.stopped:
            await self.transport.beat(Heartbeat(ENGINE_ID, INCARNATION, MODEL_NAME, 2048, engine_stats()))
            await asyncio.sleep(BEAT_S)

    async def step(self) -> None:
        for request_id in await self.transport.aborts():
            if self.running.pop(request_id, None) is not None:
                self.aborted.append(request_id)
        events: list[tuple[str, ReplyEvent]] = []
        for msg in await self.transport.pull(self.max_running - len(self.running)):
            self.running[msg.request_id] = _Running(msg.params["max_tokens"] or 16)
            self.gateway_of[msg.request_id] = msg.gateway_id
            events.append((msg.request_id, ReplyEvent(EventKind.ACCEPTED, ENGINE_ID, INCARNATION)))
        for request_id, run in list(self.running.items()):
            events.append((request_id, self._token(run)))
            if run.sent == run.max_tokens:
                del self.running[request_id]
        await self._publish(self.duplicate + events)
        self.duplicate = []

    def _token(self, run: _Running) -> ReplyEvent:
        index, run.sent = run.sent, run.sent + 1
        reason = "length" if run.sent == run.max_tokens else None
        return ReplyEvent(EventKind.OUTPUT, ENGINE_ID, INCARNATION, [ChoiceDelta(0, [token_id(index)], None, reason)],
                          finished=reason is not None, index=index)

    async def _publish(self, events: list[tuple[str, ReplyEvent]]) -> None:
        by_gateway: defaultdict[str, list[tuple[str, ReplyEvent]]] = defaultdict(list)
        for request_id, event in events:
            by_gateway[self.gateway_of[request_id]].append((request_id, event))
        for gateway_id, batch in by_gateway.items():
            await self.transport.publish(gateway_id, encode_batch(ReplyBatch(ENGINE_ID, INCARNATION, batch)))

