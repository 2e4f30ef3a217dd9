"""The broker as the gateway and the worker see it, whatever carries the messages.

Two implementations keep the same rules: ``service.broker`` (Redis streams, for
deployments) and ``service.memory_broker`` (one process, for unit tests). Their
gateway sides share ``ReplyRouter``, the bookkeeping that does not depend on transport.

- A worker takes new requests only when it polls with room (pull-based balancing).
- Each request's replies reach its gateway in the order the worker published them.
- Every worker sees every abort on its next poll, also for requests still queued.
- A request's queue entry is acked only when the request has finished.
- A request runs on one engine at a time: a duplicated queue entry is dropped, and a dead
  engine's unfinished requests are resumed by a live one (Redis only: one process never dies alone).
- Gateways know the live engines from their heartbeats, and fail a request whose
  engine stopped beating (or every queued request once no engine is left).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from service.messages import EventKind, GatewayBeat, Heartbeat, Progress, ReplyEvent, RequestMsg, SchemaError, decode
from service.transcript import Transcript


class BrokerUnavailable(Exception):
    """The broker cannot be reached."""


@dataclass(slots=True)
class RequestHandle:
    """What a worker keeps per owned request to answer and ack it."""

    request_id: str
    gateway_id: str
    entry_id: bytes  # the broker's id of the queue entry


@dataclass(slots=True)
class Pulled:
    handle: RequestHandle
    msg: RequestMsg | None  # None when the payload could not be read
    error: str | None = None
    resume: Transcript | None = None  # taken over from a dead engine: what it delivered
    deliveries: int = 0  # how many engines had the request before this one


def read_request(entry_id: bytes, payload: bytes) -> Pulled:
    try:
        msg = decode(RequestMsg, payload)
    except SchemaError as exc:
        return Pulled(RequestHandle("", "", entry_id), None, f"unreadable request: {exc}")
    return Pulled(RequestHandle(msg.request_id, msg.gateway_id, entry_id), msg)


class GatewayBroker(Protocol):
    """A gateway's side: submit, abort, the replies of its requests, the live engines."""

    gateway_id: str
    engines: dict[str, Heartbeat]  # live engines by id
    reachable: bool

    @property
    def num_pending(self) -> int: ...
    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def submit(self, msg: RequestMsg) -> asyncio.Queue[ReplyEvent]: ...
    async def abort(self, request_id: str) -> None: ...
    def release(self, request_id: str) -> None: ...


class WorkerBroker(Protocol):
    """An engine worker's side: pull requests (a duplicated entry is dropped, never returned), read
    aborts, publish replies with checkpoints, take over dead engines' requests, see the live gateways,
    beat. A transport failure surfaces as ``BrokerUnavailable`` from any of these calls; a failed
    ``publish`` may have landed in part, and is called again with the same items."""

    engine_id: str
    incarnation: str  # of this process: a restarted engine keeps its id, not its incarnation

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def poll(self, count: int, block: bool) -> tuple[list[Pulled], list[str]]: ...
    async def publish(self, items: list[tuple[RequestHandle, ReplyEvent]], checkpoints: list[Progress]) -> None: ...
    async def ack(self, handle: RequestHandle) -> None: ...
    async def dead_letter(self, handle: RequestHandle, reason: str) -> None: ...
    async def reclaim(self, room: int) -> list[Pulled]: ...
    async def taken_over(self, handles: list[RequestHandle]) -> list[RequestHandle]: ...
    async def gateways(self) -> dict[str, GatewayBeat]: ...
    async def heartbeat(self, beat: Heartbeat) -> None: ...


@dataclass(slots=True)
class _Subscription:
    queue: asyncio.Queue[ReplyEvent]
    owner: tuple[str, str] | None = None  # (engine id, incarnation) once an engine accepted the request
    last_id: bytes = b"0-0"  # the last reply entry read, where a stream-reading broker resumes


class ReplyRouter:
    """The gateway side's bookkeeping, the same over any transport: a reply queue per
    request, its owning engine, the live engines, and failing requests left without one."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self.engines: dict[str, Heartbeat] = {}
        self.reachable = False
        self._subs: dict[str, _Subscription] = {}

    @property
    def num_pending(self) -> int:
        """Requests submitted here that no engine has taken yet."""
        return sum(1 for s in self._subs.values() if s.owner is None)

    def release(self, request_id: str) -> None:
        self._subs.pop(request_id, None)

    def _open(self, request_id: str) -> asyncio.Queue[ReplyEvent]:
        self._subs[request_id] = _Subscription(asyncio.Queue())
        return self._subs[request_id].queue

    def _deliver(self, sub: _Subscription, payload: bytes) -> None:
        try:
            event = decode(ReplyEvent, payload)
        except SchemaError as exc:
            event = ReplyEvent(EventKind.ERROR, "", finished=True, error=f"bad reply from engine: {exc}")
        if event.kind is EventKind.ACCEPTED:
            sub.owner = (event.engine_id, event.incarnation)
        sub.queue.put_nowait(event)

    async def _refresh_engines(self) -> None:
        raise NotImplementedError

    async def _watch_engines(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self._refresh_engines()
            self._fail_orphans()

    def _fail_orphans(self) -> None:
        """Ends requests whose engine stopped beating (or all, when none is left)."""
        for request_id, sub in list(self._subs.items()):
            if self._owner_alive(sub.owner):
                continue
            engine_id = sub.owner[0] if sub.owner else ""
            reason = f"engine {engine_id} stopped responding" if engine_id else "no engine is available"
            if not self.reachable:
                reason = "the broker (Redis) is unreachable"
            sub.queue.put_nowait(ReplyEvent(EventKind.ERROR, engine_id, finished=True, error=reason, status=503))
            self._subs.pop(request_id)

    def _owner_alive(self, owner: tuple[str, str] | None) -> bool:
        if owner is None:  # still queued: fine while any engine may take it
            return bool(self.engines)
        beat = self.engines.get(owner[0])
        return beat is not None and beat.incarnation == owner[1]
