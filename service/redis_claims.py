"""Which requests a Redis worker runs: each request's owner key names the consumer that runs it (``SET owner
NX``), so a duplicated queue entry (a retried XADD) is acked and dropped, never run twice; a request is taken
over (owner key set, transcript read) when its owner is dead. Also the raw commands and entry shapes the
worker broker's parts share.
"""
from __future__ import annotations

import logging
from collections import defaultdict

import redis.asyncio as aioredis

from service.broker import GROUP, UNFINISHED_TTL_S, get_many
from service.broker_api import Pulled, RequestHandle, read_request
from service.messages import Heartbeat, SchemaError, StreamRecord, decode
from service.redis_keys import RESUMES, Keys, split_consumer
from service.step_lane import Command
from service.transcript import read_transcript

log = logging.getLogger(__name__)

Entry = tuple[str, bytes, dict]  # (stream, entry id, fields)
EntryKey = tuple[str, bytes]  # (stream, entry id)


def entry_key(handle: RequestHandle, default_stream: str) -> EntryKey:
    return handle.stream or default_stream, handle.entry_id


def read_entries(entries: list[Entry]) -> list[Pulled]:
    return [read_request(entry_id, fields.get(b"p", b""), stream) for stream, entry_id, fields in entries]


def stream_entries(reply: list | None) -> list[Entry]:
    """An XREADGROUP reply's entries, each with its stream."""
    return [(stream.decode(), e, f) for stream, entries in reply or [] for e, f in entries]


def ack_commands(handles: list[RequestHandle], default_stream: str) -> list[Command]:
    """Each handle's entry acked and deleted, in the stream it came from."""
    by_stream: defaultdict[str, list[bytes]] = defaultdict(list)
    for handle in handles:
        stream, entry_id = entry_key(handle, default_stream)
        by_stream[stream].append(entry_id)
    return [command for stream, ids in by_stream.items()
            for command in (("XACK", stream, GROUP, *ids), ("XDEL", stream, *ids))]


async def execute(client: aioredis.Redis, commands: list[Command]) -> list:
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return await pipe.execute()


def alive(beat: bytes | None, incarnation: str) -> bool:
    """Whether an engine's beat names this incarnation of it."""
    if beat is None:
        return False
    try:
        return decode(Heartbeat, beat).incarnation == incarnation
    except SchemaError:
        return True  # an engine of another release beats there: not ours to take over


class Claims:
    """The entries this consumer runs (``running``, by stream and entry id) and its requests' owner keys."""

    def __init__(self, client: aioredis.Redis, keys: Keys, consumer: str, default_stream: str) -> None:
        self._client = client
        self._keys = keys
        self._consumer = consumer
        self._default_stream = default_stream
        self._running: set[EntryKey] = set()

    def not_running(self, entries: list[Entry]) -> list[Entry]:
        """The entries but those this consumer runs already: a replica promoted after the delivery of one,
        without it (replication is asynchronous), delivers it again."""
        return [(stream, e, f) for stream, e, f in entries if (stream, e) not in self._running]

    def runs(self, stream: str, entry_id: bytes) -> bool:
        return (stream, entry_id) in self._running

    def adopt(self, pulled: list[Pulled]) -> None:
        """Entries claimed for this consumer otherwise (XCLAIM)."""
        self._running.update(self._key(p.handle) for p in pulled)

    def release(self, handles: list[RequestHandle]) -> None:
        """Entries acked: their requests finished, or needed no reply."""
        self._running.difference_update(self._key(h) for h in handles)

    async def claim(self, entries: list[Entry], mine_ok: bool) -> list[Pulled]:
        """Each request's owner key, set if absent (see ``claimed``)."""
        pulled = read_entries(entries)
        readable = [p for p in pulled if p.msg is not None]
        owners = await self.own([p.msg.request_id for p in readable]) if readable else []
        return await self.claimed(entries, pulled, owners, mine_ok)

    async def claimed(self, entries: list[Entry], pulled: list[Pulled], owners: list[bytes | None],
                      mine_ok: bool) -> list[Pulled]:
        """``owners``: what each readable request's owner key held before ``own``. One already set is a
        duplicate entry's (or, with ``mine_ok``, this consumer's own claim from a read whose reply was lost),
        unless the entry is a gateway's re-queue (field RESUMES) and that owner is dead: then the request is
        taken over."""
        readable = [p for p in pulled if p.msg is not None]
        if not readable:
            return pulled
        me = self._consumer.encode()
        requeued = {(stream, entry_id) for stream, entry_id, fields in entries if RESUMES.encode() in fields}
        orphans = await self._of_dead_owners([(p, old) for p, old in zip(readable, owners)
                                              if self._key(p.handle) in requeued and old != me])
        duplicates = {self._key(p.handle) for p, old in zip(readable, owners)
                      if old is not None and not (mine_ok and old == me)} - {self._key(p.handle) for p in orphans}
        await self.take_over(orphans)
        if duplicates:
            log.warning("dropping %d duplicated request entries", len(duplicates))
            dropped = [p.handle for p in pulled if self._key(p.handle) in duplicates]
            await execute(self._client, ack_commands(dropped, self._default_stream))
        kept = [p for p in pulled if self._key(p.handle) not in duplicates]
        self._running.update(self._key(p.handle) for p in kept if p.msg is not None)
        return kept

    async def own(self, request_ids: list[str]) -> list[bytes | None]:
        """Sets each request's owner key to this consumer where it is absent; the owners before."""
        pipe = self._client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.set(self._keys.owner(request_id), self._consumer, nx=True, get=True, ex=UNFINISHED_TTL_S)
        return await pipe.execute()

    def own_commands(self, request_ids: list[str]) -> list[Command]:
        """``own`` for the step lane, whose replies are raw (redis-py's SET callback needs its ``get``
        keyword to return the old value, so ``own`` keeps the keyword form)."""
        return [("SET", self._keys.owner(rid), self._consumer, "NX", "GET", "EX", UNFINISHED_TTL_S)
                for rid in request_ids]

    async def take_over(self, pulled: list[Pulled]) -> None:
        """Owner keys set to this consumer, and each request's transcript read: the engine resumes it."""
        if not pulled:
            return
        pipe = self._client.pipeline(transaction=False)
        for p in pulled:
            pipe.set(self._keys.owner(p.msg.request_id), self._consumer, ex=UNFINISHED_TTL_S)
        await pipe.execute()
        for p in pulled:
            p.resume = await read_transcript(self._client, self._keys, _record_of(p))

    async def taken_over(self, handles: list[RequestHandle]) -> list[RequestHandle]:
        """Those of these requests whose owner key names another consumer now: another engine resumed them
        while this one looked dead. A missing owner key (Redis restarted empty) is no other engine's claim:
        it is set again, so a re-submitted entry of the request is dropped as a duplicate, not run twice."""
        owners = await self.own([h.request_id for h in handles]) if handles else []
        me = self._consumer.encode()
        lost = [h for h, owner in zip(handles, owners) if owner is not None and owner != me]
        self.release(lost)
        return lost

    async def _of_dead_owners(self, claimed: list[tuple[Pulled, bytes | None]]) -> list[Pulled]:
        """Those whose owner before (None: its key was lost too) is not a live engine's consumer."""
        owners = [split_consumer(old.decode()) if old else ("", "") for _, old in claimed]
        beats = await get_many(self._client, [self._keys.engine(engine_id) for engine_id, _ in owners])
        return [p for (p, _), (_, incarnation), beat in zip(claimed, owners, beats) if not alive(beat, incarnation)]

    def _key(self, handle: RequestHandle) -> EntryKey:
        return entry_key(handle, self._default_stream)


def _record_of(pulled: Pulled) -> StreamRecord:
    """What ``read_transcript`` needs of the StreamRecord, from the request itself (it names the gateway
    and its arrival, the gateway's wall clock at submission): no GET, and no dependence on the record."""
    msg = pulled.msg
    return StreamRecord(request_id=msg.request_id, gateway_id=msg.gateway_id, body=b"",
                        prompt_token_ids=msg.prompt_token_ids, created=0, arrival_ms=int(msg.arrival_time * 1000),
                        tenant="")
