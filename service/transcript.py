"""A request's delivered replies read back from Redis: what a resuming engine continues from (its
tokens so far) and what a resuming gateway replays to a reconnected client. Costs one GET and a scan of
the gateway stream's tail since the last Progress checkpoint, never one read per token. Replies lost
with Redis (restarted empty) leave a hole, which is noted (``hole_before``), never stepped over."""
from __future__ import annotations

from dataclasses import dataclass, field

import redis.asyncio as aioredis

from service.messages import (CONTROL_INDEX, EventKind, Progress, ReplyEvent, SchemaError, StreamRecord,
                              decode_batch, decode_or_none)
from service.redis_keys import Keys

# The scan starts this long before the checkpoint (or the arrival): Redis stamps entries with its own
# clock, the checkpoint carries the engine's, and the two machines' clocks may differ by this much.
CLOCK_SKEW_MS = 5_000
_PAGE = 512


@dataclass(slots=True)
class Transcript:
    progress: Progress | None
    events: list[ReplyEvent] = field(default_factory=list)  # counted events after the checkpoint, in order
    ahead: list[int] = field(default_factory=list)  # indices found before their turn (dropped)

    @property
    def next_index(self) -> int:
        return self.events[-1].index + 1 if self.events else (self.progress.next_index if self.progress else 0)

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1].finished

    @property
    def hole_before(self) -> int | None:
        """The first index found past a hole in an unfinished transcript: the events before it are gone
        (Redis restarted empty since they were published), so nothing continues it exactly."""
        past = [i for i in self.ahead if i > self.next_index]
        return None if self.finished or not past else min(past)

    def add(self, event: ReplyEvent) -> None:
        """Keeps the next event in sequence; drops duplicates (a retried publish, two engines for a moment)
        and notes those ahead of their turn."""
        if event.index == self.next_index:
            self.events.append(event)
        elif event.index > self.next_index:
            self.ahead.append(event.index)

    def choices(self, n: int) -> tuple[list[list[int]], list[str | None]]:
        """Each choice's delivered tokens and finish reason (None while it runs)."""
        tokens = [list(t) for t in self.progress.output_token_ids] if self.progress else [[] for _ in range(n)]
        reasons = list(self.progress.finish_reasons) if self.progress else [None] * n
        for event in self.events:
            for c in event.choices:
                tokens[c.index] += c.token_ids
                reasons[c.index] = c.finish_reason or reasons[c.index]
        return tokens, reasons


async def read_transcript(client: aioredis.Redis, keys: Keys, record: StreamRecord,
                          from_checkpoint: bool = True) -> Transcript:
    """With ``from_checkpoint`` (an engine resuming: it needs the tokens) the scan starts at the last
    Progress; without (a gateway replaying a client's stream: it needs every event with its own boundaries
    and logprobs, to rebuild the same SSE events) it starts at the request's arrival."""
    # An unreadable checkpoint reads as none: the scan from arrival still finds every event.
    progress = decode_or_none(Progress, await client.get(keys.progress(record.request_id))) if from_checkpoint else None
    since_ms = max(record.arrival_ms, progress.time_ms if progress else 0) - CLOCK_SKEW_MS
    transcript = Transcript(progress)
    start = f"{max(since_ms, 0)}-0"
    while True:
        entries = await client.xrange(keys.out(record.gateway_id), min=start, max="+", count=_PAGE)
        for entry_id, fields in entries:
            _fold(transcript, record.request_id, fields.get(b"b", b""))
        if len(entries) < _PAGE:
            return transcript
        start = "(" + entries[-1][0].decode()


def _fold(transcript: Transcript, request_id: str, payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except SchemaError:
        return  # another release's entry: it cannot hold this request's events
    for rid, event in batch.events:
        if rid == request_id and event.index != CONTROL_INDEX and event.kind is not EventKind.ACCEPTED:
            transcript.add(event)
