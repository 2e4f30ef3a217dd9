"""Per-API-key priority and limits, shared by every gateway.

A key's ``KeyPolicy`` adds its priority to each of its requests' own and bounds the key's requests in flight
(``max_concurrent``) and its token rate (``tokens_per_min``: a token bucket holding a minute's worth, charged
the prompt plus ``max_tokens`` for every choice at admission, as OpenAI's limits count). Both are kept in
Redis by one script run per admission, so N gateways enforce one limit; a slot is a lease (a sorted-set
member that expires), so a gateway that dies holding slots frees them within ``lease_s``. Keys are the
tenant ids (an HMAC of the API key), never the keys themselves.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from service.errors import APIError, BrokerUnavailable

_WINDOW_MS = 60_000


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    priority: int = 0  # added to the request's own (lower is scheduled first)
    max_concurrent: int = 0  # requests in flight; 0: unbounded
    tokens_per_min: int = 0  # prompt + max_tokens per minute; 0: unbounded

    @property
    def limited(self) -> bool:
        return bool(self.max_concurrent or self.tokens_per_min)


def parse_policy(text: str) -> KeyPolicy:
    """``priority=1;max_concurrent=4;tokens_per_min=20000`` (any subset) -> KeyPolicy."""
    names = {f.name for f in fields(KeyPolicy)}
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, value = item.partition("=")
        if name not in names:
            raise ValueError(f"unknown key policy field {name!r}; known: {', '.join(sorted(names))}")
        try:
            values[name] = int(value)
        except ValueError:
            raise ValueError(f"key policy field {name!r} needs an integer, got {value!r}") from None
        if name != "priority" and values[name] < 0:
            raise ValueError(f"key policy field {name!r} must be >= 0")
    return KeyPolicy(**values)


def parse_key_policies(entries: tuple[str, ...]) -> dict[str, KeyPolicy]:
    """``KEY:policy`` entries (the key is a secret: errors never quote it) -> policy by API key."""
    policies = {}
    for i, entry in enumerate(entries):
        key, sep, policy = entry.partition(":")
        if not sep or not key:
            raise ValueError(f"--key-policy entry {i + 1} is not KEY:field=value;...")
        policies[key] = parse_policy(policy)
    return policies


class Limiter(Protocol):
    async def acquire(self, tenant: str, request_id: str, tokens: int, policy: KeyPolicy) -> float:
        """0 when the request may run (a slot is held until ``release``), else the seconds to wait."""

    async def release(self, tenant: str, request_id: str) -> None: ...


@dataclass(slots=True)
class _Bucket:
    level: float
    at_ms: float


def _refill(bucket: _Bucket, now_ms: float, capacity: int) -> None:
    bucket.level = min(capacity, bucket.level + (now_ms - bucket.at_ms) * capacity / _WINDOW_MS)
    bucket.at_ms = now_ms


class MemoryLimiter:
    """The same rules in one process (the memory broker's gateways)."""

    def __init__(self, lease_s: float) -> None:
        self.lease_ms = lease_s * 1000
        self._slots: dict[str, dict[str, float]] = {}  # tenant -> request id -> lease end (ms)
        self._buckets: dict[str, _Bucket] = {}

    async def acquire(self, tenant: str, request_id: str, tokens: int, policy: KeyPolicy) -> float:
        now = time.time() * 1000
        slots = self._slots.setdefault(tenant, {})
        for held in [r for r, end in slots.items() if end <= now]:
            del slots[held]
        if policy.max_concurrent and len(slots) >= policy.max_concurrent:
            return -1.0
        if policy.tokens_per_min:
            bucket = self._buckets.setdefault(tenant, _Bucket(policy.tokens_per_min, now))
            _refill(bucket, now, policy.tokens_per_min)
            if bucket.level < tokens:
                return (tokens - bucket.level) * _WINDOW_MS / policy.tokens_per_min / 1000
            bucket.level -= tokens
        slots[request_id] = now + self.lease_ms
        return 0.0

    async def release(self, tenant: str, request_id: str) -> None:
        self._slots.get(tenant, {}).pop(request_id, None)


# KEYS: the tenant's slots (sorted set: request id -> lease end), its bucket (hash: level, at).
# ARGV: now ms, request id, lease ms, max concurrent, tokens, tokens per minute.
# Returns "0" (granted), "-1" (no slot free) or the ms until the bucket holds the tokens.
_ACQUIRE = """
local now, lease = tonumber(ARGV[1]), tonumber(ARGV[3])
local max_concurrent, tokens, per_min = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if max_concurrent > 0 and redis.call('ZCARD', KEYS[1]) >= max_concurrent then return '-1' end
if per_min > 0 then
  local state = redis.call('HMGET', KEYS[2], 'level', 'at')
  local level, at = tonumber(state[1]) or per_min, tonumber(state[2]) or now
  level = math.min(per_min, level + (now - at) * per_min / 60000)
  if level < tokens then return tostring(math.ceil((tokens - level) * 60000 / per_min)) end
  redis.call('HSET', KEYS[2], 'level', tostring(level - tokens), 'at', tostring(now))
  redis.call('PEXPIRE', KEYS[2], 120000)
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[2])
redis.call('PEXPIRE', KEYS[1], lease)
return '0'
"""


class RedisLimiter:
    def __init__(self, client: Redis, prefix: str, lease_s: float) -> None:
        self._client = client
        self._prefix = prefix
        self.lease_ms = int(lease_s * 1000)
        self._acquire = client.register_script(_ACQUIRE)

    def _keys(self, tenant: str) -> list[str]:
        # One hash tag per tenant: a Redis Cluster keeps both keys in one slot, as the script needs.
        return [f"{self._prefix}:limit:{{{tenant}}}:slots", f"{self._prefix}:limit:{{{tenant}}}:bucket"]

    async def acquire(self, tenant: str, request_id: str, tokens: int, policy: KeyPolicy) -> float:
        now = int(time.time() * 1000)
        try:
            answer = await self._acquire(keys=self._keys(tenant), args=[
                now, request_id, self.lease_ms, policy.max_concurrent, tokens, policy.tokens_per_min])
        except RedisError as exc:
            raise BrokerUnavailable(f"Redis unavailable: {exc}") from exc
        wait_ms = int(answer)
        return -1.0 if wait_ms < 0 else wait_ms / 1000

    async def release(self, tenant: str, request_id: str) -> None:
        try:
            await self._client.zrem(self._keys(tenant)[0], request_id)
        except RedisError:
            pass  # the lease ends the slot anyway


class KeyLimits:
    """The gateway's side: each API key's policy, and its requests admitted or refused (429) by the limiter."""

    def __init__(self, policies: dict[str, KeyPolicy], default: KeyPolicy, retry_after_s: int,
                 make_limiter: Callable[[], Limiter]) -> None:
        self._policies = policies
        self._default = default
        self._retry_after_s = retry_after_s
        self._make_limiter = make_limiter  # the broker's, once it is connected
        self._limiter: Limiter | None = None
        self._releases: set[asyncio.Task] = set()

    def policy(self, api_key: str) -> KeyPolicy:
        return self._policies.get(api_key, self._default)

    async def acquire(self, api_key: str, tenant: str, request_id: str, tokens: int) -> None:
        """Holds a slot for ``request_id`` (release it at its end), or raises the 429."""
        policy = self.policy(api_key)
        if not policy.limited:
            return
        if policy.tokens_per_min and tokens > policy.tokens_per_min:
            raise APIError(429, f"the request counts {tokens} tokens (prompt + max_tokens for each choice), more "
                                f"than this API key's limit of {policy.tokens_per_min} a minute",
                           code="rate_limit_exceeded")
        wait_s = await self._get_limiter().acquire(tenant, request_id, tokens, policy)
        if wait_s == 0:
            return
        what = (f"{policy.max_concurrent} requests in flight" if wait_s < 0
                else f"{policy.tokens_per_min} tokens a minute")
        retry = self._retry_after_s if wait_s < 0 else max(1, math.ceil(wait_s))
        raise APIError(429, f"this API key's limit of {what} is reached; retry later", code="rate_limit_exceeded",
                       headers={"Retry-After": str(retry)})

    def release(self, api_key: str, tenant: str, request_id: str) -> None:
        if self.policy(api_key).limited:
            task = asyncio.get_running_loop().create_task(self._get_limiter().release(tenant, request_id))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    def _get_limiter(self) -> Limiter:
        if self._limiter is None:
            self._limiter = self._make_limiter()
        return self._limiter
