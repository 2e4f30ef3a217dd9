"""Where Responses API responses are kept for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``:
Redis for deployments (any gateway reads what another stored), a dict for the in-memory broker. A response is
its tenant's: another API key's lookup finds nothing, as for an id that never existed."""
from __future__ import annotations

import time
from typing import Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from service.errors import BrokerUnavailable
from service.messages import StoredResponse, decode_or_none, encode
from service.redis_keys import Keys


class ResponseStore(Protocol):
    async def put(self, stored: StoredResponse, ttl_s: float) -> None: ...

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str, tenant: str) -> bool:
        """Whether the tenant's response was there (and is gone now)."""


class RedisResponseStore:
    def __init__(self, client: Redis, keys: Keys) -> None:
        self._client = client
        self._keys = keys

    async def put(self, stored: StoredResponse, ttl_s: float) -> None:
        try:
            await self._client.set(self._keys.response(stored.response_id), encode(stored), px=int(ttl_s * 1000))
        except RedisError as exc:
            raise BrokerUnavailable(f"storing a response: {exc}") from exc

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        try:
            payload = await self._client.get(self._keys.response(response_id))
        except RedisError as exc:
            raise BrokerUnavailable(f"reading a response: {exc}") from exc
        stored = decode_or_none(StoredResponse, payload)
        return stored if stored is not None and stored.tenant == tenant else None

    async def delete(self, response_id: str, tenant: str) -> bool:
        if await self.get(response_id, tenant) is None:
            return False
        try:
            return bool(await self._client.delete(self._keys.response(response_id)))
        except RedisError as exc:
            raise BrokerUnavailable(f"deleting a response: {exc}") from exc


class MemoryResponseStore:
    def __init__(self) -> None:
        self._stored: dict[str, tuple[bytes, float]] = {}  # response id -> (StoredResponse, monotonic expiry)

    async def put(self, stored: StoredResponse, ttl_s: float) -> None:
        self._stored[stored.response_id] = (encode(stored), time.monotonic() + ttl_s)

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        payload, expiry = self._stored.get(response_id, (None, 0.0))
        stored = decode_or_none(StoredResponse, payload) if expiry > time.monotonic() else None
        return stored if stored is not None and stored.tenant == tenant else None

    async def delete(self, response_id: str, tenant: str) -> bool:
        if await self.get(response_id, tenant) is None:
            return False
        del self._stored[response_id]
        return True
