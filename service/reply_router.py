"""The gateway side's bookkeeping, the same over any transport (Redis, the memory bus): a reply queue per
request, fed in index order exactly once from the ReplyBatches the engines publish, the owning engine,
the live engines, and the deadlines that end a request left without one (never a hang)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from service.broker_api import HANDED_OVER_STATUS
from service.config import GatewayConfig
from service.messages import (CONTROL_INDEX, EventKind, Heartbeat, ReplyBatch, ReplyEvent, SchemaError, decode,
                              decode_batch)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Subscription:
    """One request's reply queue, and what keeps it fed in index order."""

    queue: asyncio.Queue[ReplyEvent]
    since: float  # monotonic: when it was submitted (or adopted by a resume)
    expected: int = 0  # the index of the next counted event
    owner: tuple[str, str] | None = None  # (engine id, incarnation) of the last ACCEPTED
    lost_since: float | None = None  # monotonic: since when no live engine can serve it
    held: list[ReplyEvent] | None = None  # live events kept back while a resume replays the transcript
    early: dict[int, ReplyEvent] | None = None  # by index: events past a gap, kept until it fills
    gap_since: float | None = None  # monotonic: since when ``early`` waits

    def take(self, event: ReplyEvent) -> list[ReplyEvent]:
        """The counted events deliverable now, in index order: none for a duplicate (a retried publish, a dead
        engine's late event) or for one past a gap, kept in case what is missing comes yet (an engine
        re-sending what a restarted Redis lost; else ``gap_wait_s`` later the stream ends, better an error
        than text with a hole in it); otherwise this one and those it lets through, up to one that ends."""
        if event.index < self.expected:
            return []
        if event.index > self.expected:
            if self.early is None:
                self.early, self.gap_since = {}, time.monotonic()
            self.early.setdefault(event.index, event)
            return []
        ready = [event]
        self.expected += 1
        while not _ends(ready[-1]) and self.early and self.expected in self.early:
            ready.append(self.early.pop(self.expected))
            self.expected += 1
        if not self.early:
            self.early = self.gap_since = None
        return ready

    def lost_reason(self, reachable: bool, waited_s: float) -> str:
        """Why no engine serves it any more, ``waited_s`` after it was found without one."""
        waited = f"{waited_s:g} s"
        if not reachable:
            return f"the broker (Redis) has been unreachable for {waited}"
        if self.owner is None:
            return f"no engine has been available for {waited}"
        return f"engine {self.owner[0]} stopped responding and no engine resumed the request within {waited}"


def _ends(event: ReplyEvent) -> bool:
    return event.finished or event.kind is EventKind.ERROR


class ReplyRouter:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.poll_s = config.engine_poll_s
        self.engines: dict[str, Heartbeat] = {}
        self.reachable = False
        self._subs: dict[str, Subscription] = {}
        self._read_failures = 0
        self._bad_beats: set[str] = set()  # engines whose beat did not decode, logged once
        self._background: set[asyncio.Task] = set()  # aborts in flight, kept alive here
        self._closing = asyncio.Event()

    @property
    def num_pending(self) -> int:
        """Requests submitted here that no engine has taken yet."""
        return sum(1 for s in self._subs.values() if s.owner is None)

    @property
    def num_subscriptions(self) -> int:
        return len(self._subs)

    def release(self, request_id: str) -> None:
        self._subs.pop(request_id, None)

    def subscribed(self, request_id: str, queue: asyncio.Queue[ReplyEvent]) -> bool:
        sub = self._subs.get(request_id)
        return sub is not None and sub.queue is queue

    def hand_over(self, request_id: str) -> None:
        """A newer connection resumes the request here: the older stream gets an error event and ends (its
        reader must not abort the request, which the newer one now reads)."""
        sub = self._subs.get(request_id)
        if sub is None:
            self.release(request_id)
        else:
            self._end(request_id, sub, "another connection resumed this stream", HANDED_OVER_STATUS)

    def on_accepted(self, request_id: str, engine_id: str) -> None:
        """An engine took the request (a transport that routes by what engines hold learns from it)."""

    async def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def abort_later(self, request_id: str) -> None:
        """Publishes the abort without making the caller wait (a handler that is returning)."""
        self.release(request_id)
        self._spawn(self.abort(request_id))

    def detach(self, request_id: str) -> None:
        """The client of a running stream hung up (a transport that keeps no replies: abort it now)."""
        self.abort_later(request_id)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _stop_background(self) -> None:
        """At close: aborts not published yet are left to the engines' orphan rule."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def _open(self, request_id: str, owner: tuple[str, str] | None = None,
              held: bool = False) -> asyncio.Queue[ReplyEvent]:
        sub = Subscription(asyncio.Queue(), time.monotonic(), owner=owner, held=[] if held else None)
        self._subs[request_id] = sub
        return sub.queue

    # ---- replies ----------------------------------------------------------
    def route_payload(self, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except SchemaError as exc:  # the requests it carried see a gap at their next event
            log.error("unreadable reply batch: %s", exc)
            return
        self.route(batch)

    def route(self, batch: ReplyBatch) -> None:
        for request_id, event in batch.events:
            sub = self._subs.get(request_id)
            if sub is None:
                continue  # another gateway's request, or one already ended here
            if sub.held is not None:
                sub.held.append(event)
            else:
                self._apply(request_id, sub, event)

    def replay(self, request_id: str, events: list[ReplyEvent]) -> None:
        """Ends a resume: the transcript's events, then the live ones held meanwhile (their overlap is
        dropped by index)."""
        sub = self._subs.get(request_id)
        if sub is None:
            return
        held, sub.held = sub.held or [], None
        for event in events + held:
            if self._subs.get(request_id) is not sub:
                return  # ended (finished, or a gap)
            self._apply(request_id, sub, event)

    def _apply(self, request_id: str, sub: Subscription, event: ReplyEvent) -> None:
        if event.index == CONTROL_INDEX:
            if event.kind is EventKind.ACCEPTED:  # passed on too: its handler learns an engine took it
                sub.owner, sub.lost_since = (event.engine_id, event.incarnation), None
                sub.queue.put_nowait(event)
                self.on_accepted(request_id, event.engine_id)
            return
        ready = sub.take(event)
        for delivered in ready:
            sub.queue.put_nowait(delivered)
        if ready and _ends(ready[-1]):
            self.release(request_id)

    def _end(self, request_id: str, sub: Subscription, reason: str, status: int) -> None:
        """An error made here (engine id ""): the stream's reader ends (and owes the engine an abort, unless
        the stream was handed over)."""
        sub.queue.put_nowait(ReplyEvent(EventKind.ERROR, "", finished=True, error=reason, status=status))
        self.release(request_id)

    # ---- engines and deadlines -------------------------------------------
    async def _read_beats(self) -> dict[str, bytes] | None:
        """The live engines' raw heartbeats; None when they cannot be read."""
        raise NotImplementedError

    async def _refresh_engines(self) -> None:
        beats = await self._read_beats()
        if beats is None:
            # One failed read is a blip, not a dead fleet: only N in a row empty the engine list.
            self._read_failures += 1
            if self._read_failures >= self.config.engine_read_failures:
                if self.reachable:
                    log.warning("the broker is unreachable (%d failed reads)", self._read_failures)
                self.reachable, self.engines = False, {}
            return
        self._read_failures, self.reachable = 0, True
        self.engines = {i: beat for i, payload in beats.items() if (beat := self._decode_beat(i, payload))}

    def _decode_beat(self, engine_id: str, payload: bytes) -> Heartbeat | None:
        """One by one: an unreadable beat (another release) hides that engine only."""
        try:
            beat = decode(Heartbeat, payload)
        except SchemaError as exc:
            if engine_id not in self._bad_beats:
                log.error("unreadable heartbeat of engine %s: %s", engine_id, exc)
            self._bad_beats.add(engine_id)
            return None
        self._bad_beats.discard(engine_id)
        return beat

    async def _watch(self) -> None:
        while not self._closing.is_set():
            await self._refresh_engines()
            self._check_deadlines(time.monotonic())
            try:
                await asyncio.wait_for(self._closing.wait(), self.poll_s)
            except asyncio.TimeoutError:
                pass

    async def _stop(self, task: asyncio.Task, timeout_s: float) -> None:
        """Ends a loop that watches ``_closing``; cancelled only when it is late (a redis-py command
        cancelled mid-flight can leave its connection's teardown hanging)."""
        self._closing.set()
        _, late = await asyncio.wait([task], timeout=timeout_s)
        for hung in late:
            hung.cancel()
            await asyncio.gather(hung, return_exceptions=True)

    def _check_deadlines(self, now: float) -> None:
        """A request nobody accepted in time, or whose engine died and nobody resumed, ends with a 503."""
        for request_id, sub in list(self._subs.items()):
            if sub.held is not None:
                continue  # a resume is replaying it
            if sub.gap_since is not None and now - sub.gap_since > self.config.gap_wait_s:
                self._end(request_id, sub, f"lost reply events {sub.expected}..{min(sub.early) - 1}", 500)
                continue
            if sub.owner is None and now - sub.since > self.config.accept_deadline_s:
                self._end(request_id, sub, f"no engine took the request within {self.config.accept_deadline_s:g} s",
                          503)
            elif self._served(sub.owner):
                sub.lost_since = None
            elif sub.lost_since is None:
                sub.lost_since = now
            elif now - sub.lost_since > self.config.resume_deadline_s:
                self._end(request_id, sub, sub.lost_reason(self.reachable, self.config.resume_deadline_s), 503)

    def _served(self, owner: tuple[str, str] | None) -> bool:
        if owner is None:  # still queued: fine while any engine may take it
            return bool(self.engines)
        beat = self.engines.get(owner[0])
        return beat is not None and beat.incarnation == owner[1]

