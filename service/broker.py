"""The broker over Redis streams, between gateways and engine workers (the rules
both brokers keep are in ``service.broker_api``; docs/architecture.md has the picture).

Keys under one prefix:
  {p}:requests:{model}  stream of RequestMsg for one served model, consumer group
                      "engines"; an entry is acked (and deleted) only when its
                      request has finished
  {p}:reply:{id}      one stream of ReplyEvents per request, replayable; expires
                      ``reply_ttl_s`` after the request finishes
  {p}:aborts          stream of aborted request ids, read by every worker each step
  {p}:wake:{gateway}  nudges a gateway's reader to add a new reply stream to its XREAD
  {p}:engines         set of engine ids; {p}:engine:{id} holds the Heartbeat and
                      expires when the engine stops beating
"""
from __future__ import annotations

import functools
import logging
import time

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError, ResponseError

from service.broker_api import BrokerUnavailable, Pulled, RequestHandle, read_request
from service.config import RedisConfig
from service.messages import EventKind, Heartbeat, ReplyEvent, encode

log = logging.getLogger(__name__)

GROUP = "engines"
_ABORTS_MAXLEN = 10_000
_WAKE_MAXLEN = 1_000
_UNFINISHED_TTL_S = 24 * 3600  # bounds a reply stream whose engine vanished
_COMMAND_TIMEOUT_S = 5.0
# Every command gateways, workers and the container probe send: a least-privilege Redis ACL user
# needs these, on the prefix's keys, and nothing else. (redis-py also names itself with CLIENT
# SETINFO on connect, Redis 7.2+, and ignores a refusal; README, "Redis ACL user".)
ACL_COMMANDS = ("xadd", "xread", "xreadgroup", "xack", "xdel", "xgroup|create", "del", "expire", "set", "mget",
                "sadd", "srem", "smembers", "exists", "ping", "get", "xrange", "xrevrange")


def acl_rules(prefix: str) -> str:
    """The ``ACL SETUSER <name> on ><password>`` rules for a pagedserve user (README, "Redis ACL user")."""
    return f"~{prefix}:* resetchannels -@all " + " ".join(f"+{c}" for c in ACL_COMMANDS)


class Keys:
    __slots__ = ("prefix", "aborts", "engines")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.aborts = f"{prefix}:aborts"
        self.engines = f"{prefix}:engines"

    def requests(self, model: str) -> str:
        """One request stream per served model, so an engine never takes another model's requests."""
        return f"{self.prefix}:requests:{model}"

    def reply(self, request_id: str) -> str:
        return f"{self.prefix}:reply:{request_id}"

    def wake(self, gateway_id: str) -> str:
        return f"{self.prefix}:wake:{gateway_id}"

    def engine(self, engine_id: str) -> str:
        return f"{self.prefix}:engine:{engine_id}"


def connect(config: RedisConfig, blocking: bool = False, retries: int = 0) -> aioredis.Redis:
    """A client; a blocking one gets a socket timeout just above the block time. redis-py retries a
    command ``retries`` times on a connection error or timeout (none by default: a retried XADD or
    pipeline whose first try landed runs twice, so only callers whose commands are idempotent ask)."""
    timeout = config.block_ms / 1000 + 1.0 if blocking else _COMMAND_TIMEOUT_S
    # A blocking pool: at its cap a command waits (up to the command timeout) for a free connection,
    # where the default pool raises MaxConnectionsError at once and a burst of requests would get 503s.
    pool = aioredis.BlockingConnectionPool.from_url(
        config.url, max_connections=config.max_connections, timeout=_COMMAND_TIMEOUT_S, socket_timeout=timeout,
        socket_connect_timeout=_COMMAND_TIMEOUT_S, protocol=2, decode_responses=False,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries), **config.connection_options())
    return aioredis.Redis.from_pool(pool)


async def ensure_group(client: aioredis.Redis, requests: str) -> None:
    try:
        # From "0": requests queued before the first engine started are served too.
        await client.xgroup_create(requests, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _unavailable_on_error(method):
    """The worker sees ``BrokerUnavailable`` whatever the transport raised, so it needs no Redis types."""
    @functools.wraps(method)
    async def wrapper(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except (RedisError, OSError) as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {type(exc).__name__}") from exc
    return wrapper


class RedisWorkerBroker:
    """An engine worker's side: pull requests, read aborts, publish outputs, beat."""

    def __init__(self, config: RedisConfig, engine_id: str, model: str, reply_ttl_s: int,
                 heartbeat_ttl_s: float) -> None:
        self.config = config
        self.engine_id = engine_id
        self._keys = Keys(config.prefix)
        self._requests = self._keys.requests(model)
        self._reply_ttl_s = reply_ttl_s
        self._heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self._client: aioredis.Redis | None = None
        self._blocking: aioredis.Redis | None = None
        self._abort_cursor = b"0-0"

    async def start(self) -> None:
        self._client, self._blocking = connect(self.config), connect(self.config, blocking=True)
        await ensure_group(self._client, self._requests)
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

    @_unavailable_on_error
    async def poll(self, count: int, block: bool) -> tuple[list[Pulled], list[str]]:
        """Up to ``count`` new requests (waiting for one if ``block``) and new aborts."""
        try:
            return await self._poll(count, block)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await ensure_group(self._client, self._requests)  # Redis restarted empty
            return [], []

    async def _poll(self, count: int, block: bool) -> tuple[list[Pulled], list[str]]:
        if block and count:
            entries = await self._blocking.xreadgroup(GROUP, self.engine_id, {self._requests: ">"},
                                                      count=count, block=self.config.block_ms)
            aborts = await self._client.xread({self._keys.aborts: self._abort_cursor})
        else:
            pipe = self._client.pipeline(transaction=False)
            if count:
                pipe.xreadgroup(GROUP, self.engine_id, {self._requests: ">"}, count=count)
            pipe.xread({self._keys.aborts: self._abort_cursor})
            results = await pipe.execute()
            entries, aborts = (results if count else ([], results[0]))
        pulled = [read_request(e, f.get(b"p", b"")) for _, stream in entries or [] for e, f in stream]
        return pulled, self._read_aborts(aborts)

    def _read_aborts(self, response: list) -> list[str]:
        ids = []
        for _, entries in response or []:
            for entry_id, fields in entries:
                self._abort_cursor = entry_id
                ids.append(fields.get(b"r", b"").decode())
        return ids

    @_unavailable_on_error
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
                    pipe.xack(self._requests, GROUP, handle.entry_id)
                    pipe.xdel(self._requests, handle.entry_id)
        await pipe.execute()

    @_unavailable_on_error
    async def ack(self, entry_id: bytes) -> None:
        """Drops an entry that cannot be answered (unreadable payload)."""
        await self._client.xack(self._requests, GROUP, entry_id)
        await self._client.xdel(self._requests, entry_id)

    @_unavailable_on_error
    async def heartbeat(self, beat: Heartbeat) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._keys.engine(self.engine_id), encode(beat), px=self._heartbeat_ttl_ms)
        pipe.sadd(self._keys.engines, self.engine_id)
        await pipe.execute()
