"""What both sides of the Redis broker share: the client (with its retry policy), the request streams'
consumer group, the ACL a least-privilege user needs, and Redis errors surfacing as ``BrokerUnavailable``.
The key layout is in ``service.redis_keys``; the worker's side is ``service.redis_worker``.
"""
from __future__ import annotations

import functools
import logging

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (ConnectionError as RedisConnectionError, RedisError, ResponseError,
                              TimeoutError as RedisTimeoutError)

from service.broker_api import BrokerUnavailable
from service.config import RedisConfig

log = logging.getLogger(__name__)

GROUP = "engines"
COMMAND_TIMEOUT_S = 5.0
UNFINISHED_TTL_S = 24 * 3600  # bounds the keys of a request no engine finished (its engines all vanished)
# What a failed Redis call raises; uvloop raises RuntimeError writing to a transport the peer reset.
BROKER_ERRORS = (RedisError, OSError, RuntimeError)
ACL_COMMANDS = ("xadd", "xread", "xreadgroup", "xack", "xdel", "xgroup|create", "xgroup|delconsumer", "xrange",
                "xrevrange", "xclaim", "xpending", "xinfo|consumers", "del", "expire", "get", "set", "mget", "sadd",
                "srem", "smembers", "exists", "ping")


def acl_rules(prefix: str) -> str:
    """The ``ACL SETUSER <name> on ><password>`` rules for a pagedserve user (README, "Redis ACL user")."""
    return f"~{prefix}:* resetchannels -@all " + " ".join(f"+{c}" for c in ACL_COMMANDS)


def connect(config: RedisConfig, blocking: bool = False, retries: int = 0) -> aioredis.Redis:
    """A client; a blocking one gets a socket timeout just above the block time. redis-py retries a
    command ``retries`` times on a connection error or timeout (none by default: a retried XADD or
    pipeline whose first try landed runs twice, so only callers whose commands are idempotent ask); also
    on uvloop's RuntimeError, a pooled connection whose peer reset it (a Redis restart, a proxy)."""
    timeout = config.block_ms / 1000 + 1.0 if blocking else COMMAND_TIMEOUT_S
    # A blocking pool: at its cap a command waits (up to the command timeout) for a free connection,
    # where the default pool raises MaxConnectionsError at once and a burst of requests would get 503s.
    pool = aioredis.BlockingConnectionPool.from_url(
        config.url, max_connections=config.max_connections, timeout=COMMAND_TIMEOUT_S, socket_timeout=timeout,
        socket_connect_timeout=COMMAND_TIMEOUT_S, protocol=2, decode_responses=False,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries,
                    (RedisConnectionError, RedisTimeoutError, RuntimeError)),
        **config.connection_options())
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
        except BROKER_ERRORS as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {type(exc).__name__}") from exc
    return wrapper
