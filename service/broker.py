"""What both sides of the Redis broker share: the client (with its retry policy), the request streams'
consumer group, the ACL a least-privilege user needs, and Redis errors surfacing as ``BrokerUnavailable``.
The key layout is in ``service.redis_keys``; the worker's side is ``service.redis_worker``.

(``RedisGatewayBroker`` below still speaks the v4 per-request reply streams: it moves to
``service.redis_gateway`` on the v5 wire, with the old ``Keys``.)
"""
from __future__ import annotations

import asyncio
import functools
import logging
import uuid

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from service.broker_api import BrokerUnavailable, ReplyRouter
from service.config import RedisConfig
from service.messages import Heartbeat, ReplyEvent, RequestMsg, SchemaError, decode, encode

log = logging.getLogger(__name__)

GROUP = "engines"
_ABORTS_MAXLEN = 10_000
_COMMAND_TIMEOUT_S = 5.0
# Every command gateways, workers and the container probe send: a least-privilege Redis ACL user
# needs these, on the prefix's keys, and nothing else. (redis-py also names itself with CLIENT
# SETINFO on connect, Redis 7.2+, and ignores a refusal; README, "Redis ACL user".)
ACL_COMMANDS = ("xadd", "xread", "xreadgroup", "xack", "xdel", "xgroup|create", "del", "expire", "set", "mget",
                "sadd", "srem", "smembers", "exists", "ping",
                "get", "xrange", "xclaim", "xpending", "xinfo|consumers", "xgroup|delconsumer")


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


def connect(config: RedisConfig, blocking: bool = False) -> aioredis.Redis:
    """A client; a blocking one gets a socket timeout just above the block time.

    redis-py never retries a command here (``Retry(NoBackoff(), 0)``): a retried XADD or pipeline whose
    first try landed would run a request twice or duplicate replies, and a retried blocking read can
    lose what the first one was delivered. The callers retry where that is safe, knowing what landed."""
    timeout = config.block_ms / 1000 + 1.0 if blocking else _COMMAND_TIMEOUT_S
    # A blocking pool: at its cap a command waits (up to the command timeout) for a free connection,
    # where the default pool raises MaxConnectionsError at once and a burst of requests would get 503s.
    pool = aioredis.BlockingConnectionPool.from_url(
        config.url, max_connections=config.max_connections, timeout=_COMMAND_TIMEOUT_S, socket_timeout=timeout,
        socket_connect_timeout=_COMMAND_TIMEOUT_S, retry=Retry(NoBackoff(), 0), protocol=2, decode_responses=False, **config.connection_options())
    return aioredis.Redis.from_pool(pool)


async def ensure_group(client: aioredis.Redis, requests: str) -> None:
    try:
        # From "0": requests queued before the first engine started are served too.
        await client.xgroup_create(requests, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class RedisGatewayBroker(ReplyRouter):
    """A gateway's side: submit, abort, and one reader multiplexing all reply streams."""

    def __init__(self, config: RedisConfig, poll_s: float = 0.5) -> None:
        super().__init__(poll_s)
        self.config = config
        self.gateway_id = uuid.uuid4().hex[:12]
        self._keys = Keys(config.prefix)
        self._client: aioredis.Redis | None = None
        self._blocking: aioredis.Redis | None = None
        self._wake_id = b"0-0"
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._closing = False

    async def start(self) -> None:
        self._client, self._blocking = connect(self.config), connect(self.config, blocking=True)
        await self._refresh_engines()
        self._reader = asyncio.create_task(self._read_replies())
        self._watcher = asyncio.create_task(self._watch_engines())

    async def close(self) -> None:
        # The reader's blocking XREAD is woken, not cancelled: a read cancelled mid-flight
        # can leave redis-py's connection teardown waiting forever.
        self._closing = True
        self._watcher.cancel()
        await asyncio.gather(self._watcher, return_exceptions=True)
        wake = self._keys.wake(self.gateway_id)
        try:
            await self._client.xadd(wake, {"r": ""})
        except RedisError:
            pass  # then the read returns within block_ms, or fails
        _, late = await asyncio.wait([self._reader], timeout=self.config.block_ms / 1000 + _COMMAND_TIMEOUT_S)
        for task in late:  # Redis hung: give up on the read rather than on shutting down
            task.cancel()
        try:
            await self._client.delete(wake)
        except RedisError:
            pass
        await self._client.aclose()
        await self._blocking.aclose()

    async def submit(self, msg: RequestMsg) -> asyncio.Queue[ReplyEvent]:
        payload = encode(msg)  # first: a message that cannot be encoded leaves nothing pending
        queue = self._open(msg.request_id)
        try:
            await self._client.xadd(self._keys.requests(msg.model), {"p": payload})
        except RedisError as exc:
            self.release(msg.request_id)
            raise BrokerUnavailable(f"cannot reach Redis: {type(exc).__name__}") from exc
        return queue

    async def abort(self, request_id: str) -> None:
        """Tells whichever engine owns (or will pull) the request to drop it."""
        self.release(request_id)
        try:
            await self._client.xadd(self._keys.aborts, {"r": request_id}, maxlen=_ABORTS_MAXLEN)
        except RedisError as exc:
            log.warning("could not publish abort of %s: %s", request_id, type(exc).__name__)

    async def _read_replies(self) -> None:
        wake_key = self._keys.wake(self.gateway_id).encode()
        reply_prefix = self._keys.reply("").encode()
        while not self._closing:
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
            self._deliver(sub, fields.get(b"p", b""))

    async def _refresh_engines(self) -> None:
        try:
            # No consumer group here: workers create their model's group from "0" (also after a Redis
            # restart, on NOGROUP), so requests added before it exists are read too.
            ids = sorted(i.decode() for i in await self._client.smembers(self._keys.engines))
            beats = await self._client.mget([self._keys.engine(i) for i in ids]) if ids else []
            dead = [i for i, b in zip(ids, beats) if b is None]
            if dead:
                await self._client.srem(self._keys.engines, *dead)
            self.engines = {i: decode(Heartbeat, b) for i, b in zip(ids, beats) if b is not None}
            self.reachable = True
        except (RedisError, OSError) as exc:
            if self.reachable:
                log.warning("Redis unreachable: %s", type(exc).__name__)
            self.reachable, self.engines = False, {}
        except SchemaError as exc:
            log.error("unreadable heartbeat: %s", exc)


def _unavailable_on_error(method):
    """The worker sees ``BrokerUnavailable`` whatever the transport raised, so it needs no Redis types."""
    @functools.wraps(method)
    async def wrapper(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except (RedisError, OSError) as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {type(exc).__name__}") from exc
    return wrapper
