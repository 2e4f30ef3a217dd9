"""A worker's replies on their way to the broker.

Replies are never dropped on a broker error: they stay in the outbox, in order, and go out with the next try
(the gateway drops what landed twice, by index), for up to ``reply_ttl_s``. Each publish carries the
checkpoints due with it: a checkpoint never covers an event that has not gone out with it. What went out in
the last ``replay_window_s`` is kept in the ``SentLog``: Redis without persistence may ack replies and die
before a gateway reads them (``service.worker_recovery`` sends them again).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from service.broker_api import Reply, RequestHandle
from service.config import WorkerConfig
from service.errors import BrokerUnavailable
from service.messages import Progress
from service.worker_runs import Run

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outgoing:
    """One publish: the outbox's replies and the checkpoints due with them."""

    items: list[Reply]
    runs: list[Run]  # the checkpoints' runs
    checkpoints: list[Progress]


@dataclass(slots=True)
class SentLog:
    """The replies sent in the last ``window_s``. Counted back from the first failed publish while an outage
    lasts, so the publishes into a restarted Redis (before a beat finds it empty) do not push them out."""

    window_s: float
    outage_since: float | None = None  # monotonic: the first failed publish since the last good beat
    entries: deque[tuple[float, list[Reply]]] = field(default_factory=deque)  # (monotonic, items)

    def record(self, items: list[Reply]) -> None:
        now = time.monotonic()
        if items:
            self.entries.append((now, items))
        horizon = min(now, self.outage_since or now) - self.window_s
        while self.entries and self.entries[0][0] < horizon:
            self.entries.popleft()

    def outage_began(self, at: float) -> None:
        self.outage_since = self.outage_since or at

    def outage_over(self) -> None:
        self.outage_since = None

    def take(self, dropped: set[str]) -> list[Reply]:
        """The logged replies but ``dropped`` requests', as replays: no queue entry is acked again (the
        handle's entry id is empty). The log starts over."""
        items = [(RequestHandle(h.request_id, h.gateway_id, b""), row)
                 for _, sent in self.entries for h, row in sent if h.request_id not in dropped]
        self.entries.clear()
        self.outage_over()
        return items


class Outbox:
    """The replies not published yet (``pending``, in order), and when each owned run's checkpoint is due.
    ``pending`` changes only while no publish of it is in flight: ``outgoing`` hands out the list itself."""

    def __init__(self, config: WorkerConfig, runs: dict[str, Run]) -> None:
        self.pending: list[Reply] = []
        self.log = SentLog(config.replay_window_s)
        self._runs = runs  # read only: the owned runs, for their checkpoints
        self._reply_ttl_s = config.reply_ttl_s
        self._checkpoint_interval_s = config.checkpoint_interval_s
        self._checkpoint_at = 0.0
        self._failing_since: float | None = None

    def add(self, events: list[Reply], dropped: set[str] = frozenset()) -> None:
        """``events`` after what is pending; ``dropped`` requests' replies unpublished."""
        self.pending += events
        if dropped:
            self.pending = [item for item in self.pending if item[0].request_id not in dropped]

    def outgoing(self) -> Outgoing:
        """What goes out next: everything pending, and the requests whose delivered count moved since their
        last checkpoint, every checkpoint interval."""
        now = time.monotonic()
        runs: list[Run] = []
        if now >= self._checkpoint_at:
            self._checkpoint_at = now + self._checkpoint_interval_s
            runs = [run for run in self._runs.values() if run.next_index != run.checkpointed]
        now_ms = int(time.time() * 1000)
        return Outgoing(self.pending, runs, [run.progress(now_ms) for run in runs])

    def sent(self, out: Outgoing) -> None:
        sent, self.pending, self._failing_since = self.pending[:len(out.items)], self.pending[len(out.items):], None
        for run in out.runs:
            run.checkpointed = run.next_index
        self.log.record(sent)

    def failed(self, exc: BrokerUnavailable) -> None:
        """The publish of ``outgoing`` failed: its replies go first next time, unless they have been failing
        for ``reply_ttl_s``."""
        now = time.monotonic()
        self.log.outage_began(now)
        self._failing_since = self._failing_since or now
        if now - self._failing_since < self._reply_ttl_s:
            log.warning("publishing %d replies failed, retrying: %s", len(self.pending), exc)
            return
        log.error("giving up on %d replies after %ds of broker errors", len(self.pending), self._reply_ttl_s)
        self.pending, self._failing_since = [], None

    def checkpoint_all(self) -> None:
        """Every owned run's checkpoint goes out with the next publish, not an interval later (Redis may have
        lost them: until then a resume has a hole)."""
        for run in self._runs.values():
            run.checkpointed = -1
        self._checkpoint_at = 0.0
