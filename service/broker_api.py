"""The broker as the gateway and the worker see it, whatever carries the messages.

Two implementations keep the same rules: Redis streams, for deployments
(``service.redis_gateway``, the worker's side in ``service.redis_worker``), and
``service.memory_broker`` (one process, for unit tests). Their gateway sides share
``service.reply_router.ReplyRouter``, the bookkeeping that does not depend on transport.

- A worker takes new requests only when it polls with room (pull-based balancing).
- Each request's replies reach its gateway in the order the worker published them.
- Every worker sees every abort on its next poll, also for requests still queued.
- A request's queue entry is acked only when the request has finished.
- A request runs on one engine at a time: a duplicated queue entry is dropped, and a dead
  engine's unfinished requests are resumed by a live one (Redis only: one process never dies alone).
- Gateways know the live engines from their heartbeats, and fail a request whose
  engine stopped beating (or every queued request once no engine is left).
- Each request's counted events reach its gateway once and in index order (duplicates
  dropped, a gap ends the request with an error).
- Gateways know the live engines from their heartbeats; a request whose engine stopped
  beating waits ``resume_deadline_s`` for another engine to resume it, one nobody
  accepted ``accept_deadline_s``, then it fails with a 503.
- An engine publishes KV snapshots only while a gateway asked for them in the last
  ``KV_WANTED_S`` (it learns so with each heartbeat); each expires after ``kv_snapshot_ttl_s``.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from service.messages import (EventRow, GatewayBeat, Heartbeat, Progress, ReplyEvent, RequestMsg, SchemaError,
                              StreamRecord, decode)
from service.response_store import ResponseStore
from service.transcript import Transcript

if TYPE_CHECKING:
    from service.limits import Limiter


KV_WANTED_S = 5.0  # an engine keeps publishing KV snapshots this long after a gateway last asked
# The status of the error event that ends a stream whose subscription another connection took over (a newer
# resume of the same request) or that was lost: the stream's new reader, not this one, owns the request.
HANDED_OVER_STATUS = 409


def kv_snapshot_ttl_s(interval_s: float) -> float:
    """How long a published KV snapshot stays readable: a few of the engine's intervals between them."""
    return max(KV_WANTED_S, 3 * interval_s)


@dataclass(slots=True)
class RequestHandle:
    """What a worker keeps per owned request to answer and ack it."""

    request_id: str
    gateway_id: str
    entry_id: bytes  # the broker's id of the queue entry
    stream: str = ""  # the queue it is in (Redis: the stream's key; "" where there is one queue)


@dataclass(slots=True)
class Pulled:
    handle: RequestHandle
    msg: RequestMsg | None  # None when the payload could not be read
    error: str | None = None
    resume: Transcript | None = None  # taken over from a dead engine: what it delivered
    deliveries: int = 0  # how many engines had the request before this one


Reply = tuple[RequestHandle, EventRow]  # a worker's reply event, already in its wire form


def rows_by_gateway(items: list[Reply]) -> dict[str, list[EventRow]]:
    """Each gateway's rows, in publishing order: one ReplyBatch each."""
    by_gateway: dict[str, list[EventRow]] = {}
    for handle, row in items:
        rows = by_gateway.get(handle.gateway_id)
        if rows is None:
            by_gateway[handle.gateway_id] = [row]
        else:
            rows.append(row)
    return by_gateway


def read_request(entry_id: bytes, payload: bytes, stream: str = "") -> Pulled:
    try:
        msg = decode(RequestMsg, payload)
    except SchemaError as exc:
        return Pulled(RequestHandle("", "", entry_id, stream), None, f"unreadable request: {exc}")
    return Pulled(RequestHandle(msg.request_id, msg.gateway_id, entry_id, stream), msg)


@dataclass(slots=True)
class Resumed:
    """A request a client resumes: what was submitted, and every counted event from index 0 on."""

    record: StreamRecord
    queue: asyncio.Queue[ReplyEvent]


class GatewayBroker(Protocol):
    """A gateway's side: submit, abort, the replies of its requests, the live engines."""

    gateway_id: str
    engines: dict[str, Heartbeat]  # live engines by id
    reachable: bool

    @property
    def num_pending(self) -> int: ...
    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def submit(self, msg: RequestMsg, record: StreamRecord) -> asyncio.Queue[ReplyEvent]: ...
    async def abort(self, request_id: str) -> None: ...
    def abort_later(self, request_id: str) -> None: ...
    def detach(self, request_id: str) -> None: ...
    async def resume(self, request_id: str, tenant: str) -> Resumed | None:
        """The request's replay and live events, None when unknown, expired or another ``tenant``'s (checked
        before anything changes); a stream already open here for it ends with a HANDED_OVER_STATUS event."""
    def release(self, request_id: str) -> None: ...
    def subscribed(self, request_id: str, queue: asyncio.Queue[ReplyEvent]) -> bool:
        """Whether ``queue`` still gets ``request_id``'s events."""
    def limiter(self, lease_s: float) -> Limiter: ...
    def responses(self) -> ResponseStore:
        """Where this deployment keeps Responses API responses."""
    async def kv_snapshot(self, engine_id: str) -> bytes | None:
        """The engine's latest KVSnapshotMsg (None: none yet, or expired); asks it for more for ``KV_WANTED_S``."""


@dataclass(slots=True, frozen=True)
class BeatResult:
    """What an engine's heartbeat learnt."""

    # The beat key was gone (the first beat, an expiry, Redis restarted empty) or another server answered: the
    # broker may have lost this engine's claims (see ``WorkerBroker.taken_over``).
    state_lost: bool = False
    server_changed: bool = False  # another server than at the last beat (a failover): it may lack the last writes
    kv_wanted: bool = False  # a gateway asked for this engine's KV snapshots lately


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
    async def publish(self, items: list[Reply], checkpoints: list[Progress]) -> None: ...
    async def ack(self, handle: RequestHandle) -> None: ...
    async def dead_letter(self, handle: RequestHandle, reason: str) -> None: ...
    async def reclaim(self, room: int) -> list[Pulled]: ...
    async def taken_over(self, handles: list[RequestHandle]) -> list[RequestHandle]:
        """Those of these requests another engine resumed meanwhile; the others' claims are asserted again."""
    async def gateways(self) -> dict[str, GatewayBeat]: ...
    async def heartbeat(self, beat: Heartbeat, prefixes: set[bytes] = frozenset()) -> BeatResult:
        """Beats; ``prefixes``: the engine's cached block hashes, published for routing where the broker routes."""
    async def publish_kv_snapshot(self, payload: bytes, ttl_s: float) -> None: ...


class LaneExchange(Protocol):
    """A broker's publish and poll riding on the engine's step thread (``service.step_lane``): ``send`` before
    a step and ``receive`` after it, on that thread; then, on the event loop, ``published`` (raises
    ``BrokerUnavailable`` unless the publish landed whole, as ``publish`` would) and ``polled`` (what ``poll``
    returns). ``ready`` says whether the next step may use it; when not, the worker goes through ``poll``
    and ``publish``."""

    def ready(self) -> bool: ...
    def send(self, items: list[Reply], checkpoints: list[Progress], count: int | None) -> Any: ...
    def receive(self, call: Any, count: int) -> None: ...
    def published(self, call: Any) -> None: ...
    async def polled(self, call: Any) -> tuple[list[Pulled], list[str]]: ...


@runtime_checkable
class LaneBroker(Protocol):
    """A worker broker with a step lane: ``lane`` is set by ``start`` (None where there is none, a Redis Cluster)."""

    lane: LaneExchange | None
