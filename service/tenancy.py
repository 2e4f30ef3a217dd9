"""Who is asking: the API key a request authenticated with (checked by ``authenticate``, the auth middleware),
the tenant that key stands for, and what follows from it: whose streams it may resume, which prefix-cache
blocks it shares, whose turn its tokenizer work takes, whether it sees every tenant (an admin key)."""
from __future__ import annotations

import hashlib
import hmac
import secrets

from aiohttp import web

from service.config import GatewayConfig
from service.connections import Handler
from service.errors import APIError
from service.openapi import PUBLIC_PATHS

_API_KEY = web.RequestKey("api_key", str)  # the key a request authenticated with
# Keys the tenant HMAC stored with each stream (StreamRecord.tenant): the same on every gateway, so any of
# them can check a resuming client; API keys are long random secrets, so the digest does not reveal them.
_TENANT_KEY = b"pagedserve stream tenant"


class Tenancy:
    def __init__(self, config: GatewayConfig) -> None:
        self._keys = config.all_keys
        self._admin_keys = config.admin_keys
        self._salt_secret = (config.prefix_cache_secret or secrets.token_hex(32)).encode()

    @web.middleware
    async def authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._keys and request.path not in PUBLIC_PATHS:
            request[_API_KEY] = self._matching_key(request)
            if request[_API_KEY] is None:
                raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>' or "
                                    "'x-api-key: <key>')",
                               code="invalid_api_key")
            if request.path == "/metrics" and self._admin_keys and not self.is_admin(request):
                raise APIError(403, "the metrics are totals over every tenant: they need an admin key",
                               code="admin_key_required")
        return await handler(request)

    def _matching_key(self, request: web.Request) -> str | None:
        """The key of ``Authorization: Bearer <key>``, or of Anthropic's ``x-api-key: <key>``."""
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if not given and "x-api-key" in request.headers:
            scheme, given = "bearer", request.headers["x-api-key"]
        try:
            given_bytes = given.strip().encode()
        except UnicodeEncodeError:  # undecodable header bytes (surrogates): no key matches them
            return None
        match = None
        for key in self._keys:  # no early exit: time does not depend on which key matched
            if hmac.compare_digest(given_bytes, key.encode()):
                match = key
        return match if scheme.lower() == "bearer" else None

    def api_key(self, http: web.Request) -> str:
        """The key ``http`` authenticated with; "" without keys."""
        return http.get(_API_KEY, "")

    def is_admin(self, http: web.Request) -> bool:
        """An admin key sees every tenant (without keys there are no tenants to keep apart)."""
        return not self._keys or http.get(_API_KEY) in self._admin_keys

    def tenant_of(self, http: web.Request) -> str:
        """Whose stream it is: an HMAC of the API key, the same on every gateway (never the key itself)."""
        return hmac.new(_TENANT_KEY, self.api_key(http).encode(), hashlib.sha256).hexdigest()

    def cache_salt(self, http: web.Request, request_salt: str | None) -> str:
        """The tenant's salt, HMAC(server secret, API key), then the request's own: two keys never share
        (nor, through ``cached_tokens``, reveal) prefix-cache blocks; one key shares across its requests."""
        tenant = hmac.new(self._salt_secret, self.api_key(http).encode(), hashlib.sha256).hexdigest()
        return tenant + (request_salt or "")  # fixed-length tenant part: the two cannot run into each other

    def share_of(self, http: web.Request) -> str:
        """Whose turn a tokenizer job takes: the tenant's, or without keys (no tenants) the client address's."""
        return self.tenant_of(http) if self._keys else f"peer {http.remote}"
