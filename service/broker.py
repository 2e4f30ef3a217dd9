"""Redis streams between gateways and engine workers.

Keys under one prefix:
  {p}:requests        stream of RequestMsg, consumer group "engines"; an entry is
                      acked (and deleted) only when its request has finished
  {p}:reply:{id}      one stream of ReplyEvents per request, replayable; expires
                      ``reply_ttl_s`` after the request finishes
  {p}:aborts          stream of aborted request ids, read by every worker each step
  {p}:wake:{gateway}  nudges a gateway's reader to add a new reply stream to its XREAD
  {p}:engines         set of engine ids; {p}:engine:{id} holds the Heartbeat and
                      expires when the engine stops beating
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from service.config import RedisConfig
from service.messages import EventKind, Heartbeat, ReplyEvent, RequestMsg, SchemaError, decode, encode

log = logging.getLogger(__name__)

GROUP = "engines"
_ABORTS_MAXLEN = 10_000
_WAKE_MAXLEN = 1_000
_UNFINISHED_TTL_S = 24 * 3600  # bounds a reply stream whose engine vanished
_COMMAND_TIMEOUT_S = 5.0


class BrokerUnavailable(Exception):
    """Redis cannot be reached."""


class Keys:
    __slots__ = ("prefix", "requests", "aborts", "engines")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.requests = f"{prefix}:requests"
        self.aborts = f"{prefix}:aborts"
        self.engines = f"{prefix}:engines"

    def reply(self, request_id: str) -> str:
        return f"{self.prefix}:reply:{request_id}"

    def wake(self, gateway_id: str) -> str:
        return f"{self.prefix}:wake:{gateway_id}"

    def engine(self, engine_id: str) -> str:
        return f"{self.prefix}:engine:{engine_id}"


def connect(config: RedisConfig, blocking: bool = False) -> aioredis.Redis:
    """A client; a blocking one gets a socket timeout just above the block time."""
    timeout = config.block_ms / 1000 + 1.0 if blocking else _COMMAND_TIMEOUT_S
    return aioredis.Redis.from_url(config.url, socket_timeout=timeout, socket_connect_timeout=_COMMAND_TIMEOUT_S,
                                   protocol=2, decode_responses=False)


async def ensure_group(client: aioredis.Redis, keys: Keys) -> None:
    try:
        # From "0": requests queued before the first engine started are served too.
        await client.xgroup_create(keys.requests, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


@dataclass(slots=True)
class _Subscription:
    queue: asyncio.Queue[ReplyEvent]
    last_id: bytes = b"0-0"
    owner: tuple[str, str] | None = None  # (engine id, incarnation) once an engine accepted the request


class GatewayBroker:
    """A gateway's side: submit, abort, and one reader multiplexing all reply streams."""

    def __init__(self, config: RedisConfig, gateway_id: str, poll_s: float = 0.5) -> None:
        self.config = config
        self.gateway_id = gateway_id
        self.poll_s = poll_s
        self.engines: dict[str, Heartbeat] = {}  # live engines, refreshed every poll_s
        self.redis_ok = False
        self._keys = Keys(config.prefix)
        self._client: aioredis.Redis | None = None
        self._blocking: aioredis.Redis | None = None
        self._subs: dict[str, _Subscription] = {}
        self._wake_id = b"0-0"
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._client, self._blocking = connect(self.config), connect(self.config, blocking=True)
        await self._refresh_engines()
        self._tasks = [asyncio.create_task(self._read_replies()), asyncio.create_task(self._watch_engines())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self._client.delete(self._keys.wake(self.gateway_id))
        except RedisError:
            pass
        await self._client.aclose()
        await self._blocking.aclose()

    @property
    def num_pending(self) -> int:
        """Requests submitted here that no engine has taken yet."""
        return sum(1 for s in self._subs.values() if s.owner is None)

    async def submit(self, msg: RequestMsg) -> asyncio.Queue[ReplyEvent]:
        sub = self._subs[msg.request_id] = _Subscription(asyncio.Queue())
        try:
            await self._client.xadd(self._keys.requests, {"p": encode(msg)})
        except RedisError as exc:
            self._subs.pop(msg.request_id, None)
            raise BrokerUnavailable(f"cannot reach Redis: {type(exc).__name__}") from exc
        return sub.queue

    async def abort(self, request_id: str) -> None:
        """Tells whichever engine owns (or will pull) the request to drop it."""
        self.release(request_id)
        try:
            await self._client.xadd(self._keys.aborts, {"r": request_id}, maxlen=_ABORTS_MAXLEN)
        except RedisError as exc:
            log.warning("could not publish abort of %s: %s", request_id, type(exc).__name__)

    def release(self, request_id: str) -> None:
        self._subs.pop(request_id, None)

    async def _read_replies(self) -> None:
        wake_key = self._keys.wake(self.gateway_id).encode()
        reply_prefix = self._keys.reply("").encode()
        while True:
            streams = {wake_key: self._wake_id}
            streams.update({self._keys.reply(rid): s.last_id for rid, s in self._subs.items()})
            try:
                response = await self._blocking.xread(streams, block=self.config.block_ms)
            except RedisError as exc:
                log.warning("reply reader: %s", type(exc).__name__)
                await asyncio.sleep(self.poll_s)
                continue
            for key, entries in response or []:
                if key == wake_key:
                    self._wake_id = entries[-1][0]
                else:
                    self._dispatch(key[len(reply_prefix):].decode(), entries)

    def _dispatch(self, request_id: str, entries: list) -> None:
        sub = self._subs.get(request_id)
        if sub is None:
            return
        for entry_id, fields in entries:
            sub.last_id = entry_id
            try:
                event = decode(ReplyEvent, fields[b"p"])
            except (SchemaError, KeyError) as exc:
                event = ReplyEvent(EventKind.ERROR, "", finished=True, error=f"bad reply from engine: {exc}")
            if event.kind is EventKind.ACCEPTED:
                sub.owner = (event.engine_id, event.incarnation)
            sub.queue.put_nowait(event)

    async def _watch_engines(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self._refresh_engines()
            self._fail_orphans()

    async def _refresh_engines(self) -> None:
        try:
            if not self.redis_ok:  # (re)connected: a restarted Redis has lost the group
                await ensure_group(self._client, self._keys)
            ids = sorted(i.decode() for i in await self._client.smembers(self._keys.engines))
            beats = await self._client.mget([self._keys.engine(i) for i in ids]) if ids else []
            dead = [i for i, b in zip(ids, beats) if b is None]
            if dead:
                await self._client.srem(self._keys.engines, *dead)
            self.engines = {i: decode(Heartbeat, b) for i, b in zip(ids, beats) if b is not None}
            self.redis_ok = True
        except (RedisError, OSError) as exc:
            if self.redis_ok:
                log.warning("Redis unreachable: %s", type(exc).__name__)
            self.redis_ok, self.engines = False, {}
        except SchemaError as exc:
            log.error("unreadable heartbeat: %s", exc)

    def _fail_orphans(self) -> None:
        """Ends requests whose engine stopped beating (or all, when none is left)."""
        for request_id, sub in list(self._subs.items()):
            if self._owner_alive(sub.owner):
                continue
            engine_id = sub.owner[0] if sub.owner else ""
            reason = f"engine {engine_id} stopped responding" if engine_id else "no engine is available"
            if not self.redis_ok:
                reason = "the broker (Redis) is unreachable"
            sub.queue.put_nowait(ReplyEvent(EventKind.ERROR, engine_id, finished=True, error=reason, status=503))
            self._subs.pop(request_id)

    def _owner_alive(self, owner: tuple[str, str] | None) -> bool:
        if owner is None:  # still queued: fine while any engine may take it
            return bool(self.engines)
        beat = self.engines.get(owner[0])
        return beat is not None and beat.incarnation == owner[1]


@dataclass(slots=True)
class RequestHandle:
    """What a worker keeps per owned request to answer and ack it."""

    request_id: str
    gateway_id: str
    entry_id: bytes


@dataclass(slots=True)
class Pulled:
    handle: RequestHandle
    msg: RequestMsg | None  # None when the payload could not be read
    error: str | None = None


class WorkerBroker:
    """An engine worker's side: pull requests, read aborts, publish outputs, beat."""

    def __init__(self, config: RedisConfig, engine_id: str, reply_ttl_s: int, heartbeat_ttl_s: float) -> None:
        self.config = config
        self.engine_id = engine_id
        self._keys = Keys(config.prefix)
        self._reply_ttl_s = reply_ttl_s
        self._heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self._client: aioredis.Redis | None = None
        self._blocking: aioredis.Redis | None = None
        self._abort_cursor = b"0-0"

    async def start(self) -> None:
        self._client, self._blocking = connect(self.config), connect(self.config, blocking=True)
        await ensure_group(self._client, self._keys)
        # Aborts from the last minute still matter: their requests may be queued.
        self._abort_cursor = f"{int(time.time() * 1000) - 60_000}-0".encode()

    async def close(self) -> None:
        try:
            await self._client.delete(self._keys.engine(self.engine_id))
            await self._client.srem(self._keys.engines, self.engine_id)
        except RedisError:
            pass
        await self._client.aclose()
        await self._blocking.aclose()

    async def poll(self, count: int, block: bool) -> tuple[list[Pulled], list[str]]:
        """Up to ``count`` new requests (waiting for one if ``block``) and new aborts."""
        try:
            return await self._poll(count, block)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await ensure_group(self._client, self._keys)  # Redis restarted empty
            return [], []

    async def _poll(self, count: int, block: bool) -> tuple[list[Pulled], list[str]]:
        if block and count:
            entries = await self._blocking.xreadgroup(GROUP, self.engine_id, {self._keys.requests: ">"},
                                                      count=count, block=self.config.block_ms)
            aborts = await self._client.xread({self._keys.aborts: self._abort_cursor})
        else:
            pipe = self._client.pipeline(transaction=False)
            if count:
                pipe.xreadgroup(GROUP, self.engine_id, {self._keys.requests: ">"}, count=count)
            pipe.xread({self._keys.aborts: self._abort_cursor})
            results = await pipe.execute()
            entries, aborts = (results if count else ([], results[0]))
        return [_read_request(e, f) for _, stream in entries or [] for e, f in stream], self._read_aborts(aborts)

    def _read_aborts(self, response: list) -> list[str]:
        ids = []
        for _, entries in response or []:
            for entry_id, fields in entries:
                self._abort_cursor = entry_id
                ids.append(fields.get(b"r", b"").decode())
        return ids

    async def publish(self, items: list[tuple[RequestHandle, ReplyEvent]]) -> None:
        """All events of one step in one pipeline; finished requests are acked."""
        if not items:
            return
        pipe = self._client.pipeline(transaction=False)
        for handle, event in items:
            reply = self._keys.reply(handle.request_id)
            pipe.xadd(reply, {"p": encode(event)})
            if event.kind is EventKind.ACCEPTED:
                pipe.expire(reply, _UNFINISHED_TTL_S)
                wake = self._keys.wake(handle.gateway_id)
                pipe.xadd(wake, {"r": handle.request_id}, maxlen=_WAKE_MAXLEN)
                pipe.expire(wake, _UNFINISHED_TTL_S)
            if event.finished:
                pipe.expire(reply, self._reply_ttl_s)
                if handle.entry_id:
                    pipe.xack(self._keys.requests, GROUP, handle.entry_id)
                    pipe.xdel(self._keys.requests, handle.entry_id)
        await pipe.execute()

    async def ack(self, entry_id: bytes) -> None:
        """Drops an entry that cannot be answered (unreadable payload)."""
        await self._client.xack(self._keys.requests, GROUP, entry_id)
        await self._client.xdel(self._keys.requests, entry_id)

    async def heartbeat(self, beat: Heartbeat) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._keys.engine(self.engine_id), encode(beat), px=self._heartbeat_ttl_ms)
        pipe.sadd(self._keys.engines, self.engine_id)
        await pipe.execute()


def _read_request(entry_id: bytes, fields: dict[bytes, bytes]) -> Pulled:
    try:
        msg = decode(RequestMsg, fields[b"p"])
    except (SchemaError, KeyError) as exc:
        return Pulled(RequestHandle("", "", entry_id), None, f"unreadable request: {exc}")
    return Pulled(RequestHandle(msg.request_id, msg.gateway_id, entry_id), msg)
