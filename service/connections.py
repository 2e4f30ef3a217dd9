"""The gateway's HTTP connections, guarded in front of aiohttp's protocol.

aiohttp closes a connection that sits idle past its keep-alive timeout, but a client that sends a byte
now and then is not idle: 50 connections sending headers at a byte a second were all still open after
40 s, and a trickled body likewise. Here each phase of a request has a deadline (docs/security.md,
"Connections and timeouts"):

* headers: complete within ``header_timeout_s`` of the connection's opening, or on a kept-alive
  connection of the request's first byte, or the connection is closed;
* body: complete within ``body_timeout_s`` of the request reaching the app, or its read fails with
  ``BodyTimeout`` (the gateway answers 408) and the connection is closed;
* peers: one client address holds at most ``max_connections_per_peer`` connections (loopback:
  ``max_loopback_connections``); one more is answered 429 and closed before aiohttp sees it.

``GuardedAppRunner`` wraps each of aiohttp's protocols in a ``GuardedProtocol``; ``track_requests``, the
app's outermost middleware, tells it when a request is in (its headers parsed) and when it is over.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.streams import StreamReader

from service.config import GatewayConfig
from service.errors import APIError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BodyTimeout(asyncio.TimeoutError):
    """A request's body did not arrive in time. A TimeoutError, so that aiohttp's read of an unread body
    after the response (its "lingering") ends on it and closes the connection."""


def peer_key(address: str | None) -> str | None:
    """What the per-peer cap counts: the client's address, an IPv6 one's /64 (a host commonly holds a
    whole /64), an IPv4-mapped one as IPv4; None for a non-IP peer (a unix socket: local)."""
    try:
        ip = ipaddress.ip_address((address or "").partition("%")[0])  # without an IPv6 scope id
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if not ip.is_loopback:
            return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def is_loopback_peer(key: str | None) -> bool:
    return key is None or ipaddress.ip_network(key).is_loopback


class ConnectionGuard:
    """The open connections by peer, and the limits every connection of one listener is held to."""

    __slots__ = ("config", "open_by_peer", "_refusal")

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.open_by_peer: Counter[str | None] = Counter()
        self._refusal = _too_many_connections(config.retry_after_s)

    def protocol_factory(self, server: web.Server) -> Callable[[], GuardedProtocol]:
        """What a site listens with: each connection gets aiohttp's protocol (``server()``) behind a guard."""
        return lambda: GuardedProtocol(self, server)

    def admit(self, peer: str | None) -> bool:
        cap = self.config.max_loopback_connections if is_loopback_peer(peer) else self.config.max_connections_per_peer
        if cap and self.open_by_peer[peer] >= cap:
            return False
        self.open_by_peer[peer] += 1
        return True

    def release(self, peer: str | None) -> None:
        self.open_by_peer[peer] -= 1
        if not self.open_by_peer[peer]:
            del self.open_by_peer[peer]

    def refuse(self, transport: asyncio.Transport) -> None:
        transport.write(self._refusal)
        transport.close()


def _too_many_connections(retry_after_s: int) -> bytes:
    """A whole 429 response in the API's error shape, written before closing a refused connection."""
    error = APIError(429, "too many concurrent connections from this address; retry later",
                     code="too_many_connections")
    body = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: {retry_after_s}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection (``handler``) behind the guard's admission and deadlines."""

    __slots__ = ("guard", "server", "handler", "transport", "peer", "in_request", "header_timer", "body_timer")

    def __init__(self, guard: ConnectionGuard, server: web.Server) -> None:
        self.guard = guard
        self.server = server
        self.handler: web.RequestHandler | None = None  # None until admitted
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.in_request = False
        self.header_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.peer = peer_key((transport.get_extra_info("peername") or (None,))[0])
        if not self.guard.admit(self.peer):
            self.guard.refuse(transport)
            return
        self.handler = self.server()
        self.handler.connection_made(transport)
        self._await_headers()  # a connection that never sends a request is closed too

    def data_received(self, data: bytes) -> None:
        if self.handler is None:
            return
        self.handler.data_received(data)
        # Bytes between requests start the next request's headers. (A body's tail that arrives after
        # its handler is done may start the clock too: the connection is then closed a little early.)
        if not self.in_request and self.header_timer is None:
            self._await_headers()

    def eof_received(self) -> bool | None:
        return None if self.handler is None else self.handler.eof_received()

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self.header_timer, self.body_timer):
            if timer is not None:
                timer.cancel()
        if self.handler is not None:
            self.guard.release(self.peer)
            self.handler.connection_lost(exc)

    def request_started(self, body: StreamReader) -> None:
        """The request's headers are in (it reached the app); its body's clock starts unless it is all in."""
        self.in_request = True
        self._cancel_header_timer()
        if not body.is_eof():
            self.body_timer = asyncio.get_running_loop().call_later(self.guard.config.body_timeout_s,
                                                                    self._body_late, body)

    def request_over(self) -> None:
        self.in_request = False
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None

    def _await_headers(self) -> None:
        self.header_timer = asyncio.get_running_loop().call_later(self.guard.config.header_timeout_s,
                                                                  self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_late(self) -> None:
        self.header_timer = None
        if not self.in_request:
            self.transport.close()

    def _body_late(self, body: StreamReader) -> None:
        self.body_timer = None
        if not body.is_eof():
            body.set_exception(BodyTimeout(f"the request body did not arrive within "
                                           f"{self.guard.config.body_timeout_s:g} s"))


@web.middleware
async def track_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The outermost middleware: tells the connection's guard (if it has one) that a request is in, and over."""
    transport = request.transport
    guarded = transport.get_protocol() if transport is not None else None
    if not isinstance(guarded, GuardedProtocol):  # e.g. aiohttp's TestServer, which listens unguarded
        return await handler(request)
    guarded.request_started(request.content)
    try:
        return await handler(request)
    finally:
        guarded.request_over()


class GuardedAppRunner(web.AppRunner):
    """An AppRunner whose sites take each connection through a ConnectionGuard, and close idle
    keep-alive connections after ``keepalive_timeout_s``."""

    __slots__ = ("guard",)

    def __init__(self, app: web.Application, config: GatewayConfig, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=config.keepalive_timeout_s, **kwargs)
        self.guard = ConnectionGuard(config)

    @property
    def server(self) -> Callable[[], GuardedProtocol] | None:  # what sites listen with: the guarded factory
        inner = super().server
        return None if inner is None else self.guard.protocol_factory(inner)
