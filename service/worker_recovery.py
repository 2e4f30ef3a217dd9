"""A worker's recovery after a gap: its beats lapsed (a hung step, Redis out of reach), or Redis lost its state
(restarted empty, or a promoted replica that lacks the last writes).

After a gap in the beats longer than their TTL, other engines may have resumed some of this one's requests:
those are dropped, their replies unpublished. After Redis lost its state, ownership of the rest is asserted
again, their checkpoints are written again with the next publish, and the replies it may have lost unread go
out again (the gateways drop what they had, by index). The heartbeat reports each beat here (``beat``); the
loop asks, between steps, what to drop and what to resend (``after_gap``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable

from service.broker_api import BeatResult, Reply, RequestHandle, WorkerBroker
from service.errors import BrokerUnavailable
from service.messages import EventKind
from service.outbox import Outbox
from service.worker_runs import Runs

log = logging.getLogger(__name__)


class Recovery:
    def __init__(self, broker: WorkerBroker, runs: Runs, outbox: Outbox, heartbeat_ttl_s: float) -> None:
        self._broker = broker
        self._runs = runs
        self._outbox = outbox
        self._heartbeat_ttl_s = heartbeat_ttl_s
        self._beat_ok_at = time.monotonic()
        # A beat found this engine's claims may be gone: ``after_gap`` asserts them again.
        self._state_lost = False

    async def beat(self, sending: Awaitable[BeatResult]) -> BeatResult:
        """Sends a beat (``sending``) and learns from it whether replies may have been lost unread."""
        previous_ok, was_lost = self._beat_ok_at, self._state_lost
        result = await sending
        self._beat_ok_at = time.monotonic()
        self._state_lost |= result.state_lost
        if not self._state_lost:
            self._outbox.log.outage_over()  # Redis kept its state: nothing sent before the outage was lost
        elif not was_lost and (result.server_changed or self._beat_ok_at - previous_ok <= self._heartbeat_ttl_s):
            # This beat found the key gone before its TTL (Redis restarted empty), or another server (a
            # promoted replica, which may lack the last writes): replies may have been lost unread.
            self._outbox.log.outage_began(previous_ok)
        return result

    async def after_gap(self, events: list[Reply]) -> tuple[set[str], list[Reply]]:
        """Between steps, with this iteration's ``events``: (the request ids to drop, the replies to send
        again); nothing unless the beats lapsed or Redis lost its state."""
        state_lost = self._state_lost
        if time.monotonic() - self._beat_ok_at <= self._heartbeat_ttl_s and not state_lost:
            return set(), []
        handles = {h.request_id: h for h, _ in self._outbox.pending + events}
        handles |= {rid: run.handle for rid, run in self._runs.owned.items()}
        try:
            lost = await self._taken_over(list(handles.values()))
        except BrokerUnavailable:
            return set(), []
        self._outbox.checkpoint_all()
        if lost:
            log.warning("%d requests were resumed by other engines while this one stalled: dropping them", len(lost))
            self._runs.end([rid for rid in lost if rid in self._runs.owned], EventKind.OUTPUT)
        # A beat that lapsed (a hung step) expired its key: no restart, nothing lost, unless a publish failed.
        return lost, self._resend(lost) if state_lost and self._outbox.log.outage_since is not None else []

    async def _taken_over(self, handles: list[RequestHandle]) -> set[str]:
        """The ids of those another engine resumed; the others' claims asserted again. The lost state is
        cleared before the round trip: a beat that finds its key gone meanwhile sets it again."""
        self._state_lost = False
        try:
            return {h.request_id for h in await self._broker.taken_over(handles)}
        except BaseException:
            self._state_lost = True
            raise

    def _resend(self, dropped: set[str]) -> list[Reply]:
        """The replies sent in the last ``replay_window_s`` before the outage, as replays."""
        items = self._outbox.log.take(dropped)
        if items:
            log.warning("Redis lost its state: sending the last %d replies again", len(items))
        return items
