"""What both sides of the Redis broker share: the client (with its retry policy), the request streams'
consumer group, the ACL a least-privilege user needs, and Redis errors surfacing as ``BrokerUnavailable``.
The key layout is in ``service.redis_keys``; the worker's side is ``service.redis_worker``.
"""
from __future__ import annotations

import functools
import logging

import redis
import redis.asyncio as aioredis
import redis.retry
import redis.sentinel
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import (ConnectionError as RedisConnectionError, RedisError, ResponseError,
                              TimeoutError as RedisTimeoutError)

from service.errors import BrokerUnavailable
from service.config import RedisConfig, RedisNodes

log = logging.getLogger(__name__)

GROUP = "engines"
COMMAND_TIMEOUT_S = 5.0
UNFINISHED_TTL_S = 24 * 3600  # bounds the keys of a request no engine finished (its engines all vanished)
# What a failed Redis call raises; uvloop raises RuntimeError writing to a transport the peer reset.
BROKER_ERRORS = (RedisError, OSError, RuntimeError)
ACL_COMMANDS = ("xadd", "xread", "xreadgroup", "xack", "xdel", "xgroup|create", "xgroup|delconsumer", "xrange",
                "xrevrange", "xclaim", "xpending", "xinfo|consumers", "del", "expire", "get", "set", "mget", "sadd",
                "srem", "smembers", "exists", "ping", "info",
                # prefix-aware routing: the engines' prefix sets, the routed streams' groups
                "pexpire", "smismember", "xinfo|groups",
                # per-key limits: the Lua script (loaded once) and the commands it runs
                "evalsha", "script|load", "zadd", "zrem", "zremrangebyscore", "zcard", "hmget", "hset")


def acl_rules(prefix: str) -> str:
    """The ``ACL SETUSER <name> on ><password>`` rules for a pagedserve user (README, "Redis ACL user")."""
    return f"~{prefix}:* resetchannels -@all " + " ".join(f"+{c}" for c in ACL_COMMANDS)


def connect(config: RedisConfig, blocking: bool = False, retries: int = 0) -> aioredis.Redis | RedisCluster:
    """A client; a blocking one gets a socket timeout just above the block time. redis-py retries a
    command ``retries`` times on a connection error or timeout (none by default: a retried XADD or
    pipeline whose first try landed runs twice, so only callers whose commands are idempotent ask); also
    on uvloop's RuntimeError, a pooled connection whose peer reset it (a Redis restart, a proxy).
    Behind a Sentinel set, every new connection asks the Sentinels where the primary is (a failover
    moves it); a Redis Cluster client sends each command to the node of its key's slot."""
    timeout = config.block_ms / 1000 + 1.0 if blocking else COMMAND_TIMEOUT_S
    options = dict(socket_timeout=timeout, socket_connect_timeout=COMMAND_TIMEOUT_S, protocol=2,
                   decode_responses=False, retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries,
                                                       (RedisConnectionError, RedisTimeoutError, RuntimeError)),
                   **config.connection_options())
    nodes = config.nodes()
    if nodes is not None and nodes.kind == "cluster":
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes.hosts],
                            max_connections=config.max_connections, **options)
    # A blocking pool: at its cap a command waits (up to the command timeout) for a free connection,
    # where the default pool raises MaxConnectionsError at once and a burst of requests would get 503s.
    pool_options = dict(max_connections=config.max_connections, timeout=COMMAND_TIMEOUT_S, **options)
    if nodes is not None:
        return _sentinels(Sentinel, nodes, config).master_for(
            nodes.service, connection_pool_class=_BlockingSentinelPool, db=nodes.db, **pool_options)
    return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(config.url, **pool_options))


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The Sentinel pool (connections find the primary through the Sentinels) with the blocking pool's wait."""


def sync_client(config: RedisConfig, timeout_s: float) -> redis.Redis | None:
    """A blocking (thread-side) client without retries, for one raw connection (service.step_lane); None for
    a Redis Cluster, where one connection reaches a single node's slots."""
    nodes = config.nodes()
    options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, protocol=2, decode_responses=False,
                   retry=redis.retry.Retry(NoBackoff(), 0), **config.connection_options())
    if nodes is None:
        return redis.Redis.from_url(config.url, **options)
    if nodes.kind == "sentinel":
        return _sentinels(redis.sentinel.Sentinel, nodes, config).master_for(nodes.service, db=nodes.db, **options)
    return None


def _sentinels(sentinel_class: type, nodes: RedisNodes, config: RedisConfig):
    """A Sentinel set client (``sentinel_class``: redis-py's asyncio or blocking one); the Sentinels may have
    a password of their own, never the data's."""
    auth = {"password": config.sentinel_password} if config.sentinel_password else {}
    return sentinel_class(list(nodes.hosts), sentinel_kwargs=dict(
        socket_timeout=1.0, socket_connect_timeout=1.0, **auth))


def is_cluster(client: object) -> bool:
    return isinstance(client, RedisCluster)


async def get_many(client: aioredis.Redis | RedisCluster, keys: list[str]) -> list[bytes | None]:
    """MGET; in a Redis Cluster, one per slot (redis-py's non-atomic MGET): no caller needs the values
    read at one instant, each is an independent beat or checkpoint."""
    if not keys:
        return []
    return await (client.mget_nonatomic(keys) if is_cluster(client) else client.mget(keys))


async def server_identity(client: aioredis.Redis | RedisCluster) -> frozenset[str] | None:
    """The run ids of the server(s) this client reaches (every primary, in a Cluster). Another set than at
    the last look: a failover promoted a replica, or a server restarted, and writes acked before may be gone
    (replication is asynchronous). None where INFO is not allowed (an ACL user of an older release)."""
    try:
        if is_cluster(client):
            infos = await client.info("server", target_nodes=RedisCluster.PRIMARIES)
            return frozenset(info["run_id"] for info in infos.values())
        return frozenset([(await client.info("server"))["run_id"]])
    except ResponseError:
        return None


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
