"""The requests a worker answers, and the events that end them: aborted by their client, orphaned by their
gateway, failed with the engine.

A request's counted events (OUTPUT, ERROR) are numbered 0, 1, 2, ... across engines: a resumed one continues
the count where its transcript ends.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from engine.outputs import RequestOutput, ResumeState
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

from service.broker_api import Pulled, Reply, RequestHandle
from service.engine_api import Engine
from service.messages import EventKind, EventRow, GatewayBeat, Progress, ReplyEvent, event_row, output_row

log = logging.getLogger(__name__)

_RECENT_ABORTS = 10_000  # ids remembered so a request aborted while queued is never started


@dataclass(slots=True)
class Run:
    """A request this worker answers: where its replies go, and what it delivered (for checkpoints)."""

    handle: RequestHandle
    next_index: int
    tokens: list[list[int]]  # per choice
    reasons: list[str | None]
    num_cached_tokens: int = 0
    checkpointed: int = 0  # next_index at the last checkpoint that landed (written by the outbox alone)
    tenant: str = ""  # RequestMsg.tenant: shown with its blocks in the KV snapshot

    @classmethod
    def pulled(cls, item: Pulled, n: int) -> Run:
        """A new request's run with ``n`` choices, or a resumed one's where its transcript ends."""
        if item.resume is None:
            return cls(item.handle, 0, [[] for _ in range(n)], [None] * n, tenant=item.msg.tenant)
        tokens, reasons = item.resume.choices(n)
        return cls(item.handle, item.resume.next_index, tokens, reasons, tenant=item.msg.tenant)

    def resume_state(self, params: SamplingParams | PoolingParams) -> ResumeState | None:
        """The engine continues from the delivered tokens; beam search (published only at its end) and an
        embedding request (it delivers no tokens) restart."""
        if not any(self.tokens) or params.use_beam_search:
            self.tokens, self.reasons = [[] for _ in self.tokens], [None] * len(self.reasons)
            return None
        return ResumeState([list(t) for t in self.tokens], list(self.reasons))

    def progress(self, time_ms: int) -> Progress:
        # No logprobs: a resuming engine needs the tokens only, a gateway replay reads every event.
        return Progress(request_id=self.handle.request_id, next_index=self.next_index,
                        output_token_ids=[list(t) for t in self.tokens], finish_reasons=list(self.reasons),
                        logprobs=None, num_cached_tokens=self.num_cached_tokens, time_ms=time_ms)


class Runs:
    """The owned runs by request id (``owned``), the aborts seen lately and the gateways seen gone."""

    def __init__(self, engine: Engine, engine_id: str, incarnation: str, orphan_grace_s: float) -> None:
        self.owned: dict[str, Run] = {}
        self._engine = engine
        self._engine_id = engine_id
        self._incarnation = incarnation
        self._orphan_grace_s = orphan_grace_s
        self._recent_aborts: dict[str, None] = {}
        self._gateway_gone_since: dict[str, float] = {}

    def own(self, run: Run) -> None:
        """A run whose request the engine took."""
        self.owned[run.handle.request_id] = run

    def remember_aborts(self, aborts: list[str]) -> None:
        for request_id in aborts:
            self._recent_aborts[request_id] = None
        while len(self._recent_aborts) > _RECENT_ABORTS:
            del self._recent_aborts[next(iter(self._recent_aborts))]

    def aborted(self, request_id: str) -> bool:
        return request_id in self._recent_aborts

    def abort(self, aborts: list[str]) -> list[Reply]:
        owned = [rid for rid in dict.fromkeys(aborts) if rid in self.owned]  # a gateway may abort twice
        return self.end(owned, EventKind.OUTPUT)

    def abort_orphans(self, gateways: dict[str, GatewayBeat]) -> list[Reply]:
        """Requests whose gateway has been gone for ``orphan_grace_s`` have no reader, unless a live gateway
        adopted them (their client resumed its stream there): the others are aborted."""
        now = time.monotonic()
        gone = {run.handle.gateway_id for run in self.owned.values()} - gateways.keys()
        self._gateway_gone_since = {g: self._gateway_gone_since.get(g, now) for g in gone}
        expired = {g for g, since in self._gateway_gone_since.items() if now - since >= self._orphan_grace_s}
        adopted = {rid for beat in gateways.values() for rid in beat.adopted}
        orphans = [rid for rid, run in self.owned.items() if run.handle.gateway_id in expired and rid not in adopted]
        if orphans:
            log.warning("aborting %d requests whose gateway is gone", len(orphans))
        return self.end(orphans, EventKind.ERROR, error="the request's gateway is gone", status=503)

    def end(self, request_ids: list[str], kind: EventKind, **fields: Any) -> list[Reply]:
        """Aborts owned requests in the engine (their blocks go back to the pool now), with a final event each."""
        if request_ids:
            self._engine.abort_request(request_ids)
        return self._final_events(request_ids, kind, **fields)

    def fail_all(self, error: str, status: int) -> list[Reply]:
        """Every owned request ends with an error event, even if the engine cannot abort them (a broken step)."""
        request_ids = list(self.owned)
        try:
            if request_ids:
                self._engine.abort_request(request_ids)
        except Exception:
            log.exception("abort after failure failed")
        return self._final_events(request_ids, EventKind.ERROR, error=error, status=status)

    def output(self, out: RequestOutput) -> Reply | None:
        """A step's output as its request's next event; None for a request ended here already."""
        run = self.owned.get(out.request_id)
        if run is None:
            return None
        if out.finished:
            del self.owned[out.request_id]
        if out.error:
            return run.handle, self.counted(run, EventKind.ERROR, finished=True, error=out.error)
        for c in out.outputs:
            run.tokens[c.index] += c.token_ids
            run.reasons[c.index] = c.finish_reason
        run.num_cached_tokens = out.num_cached_tokens
        run.next_index += 1
        return run.handle, output_row(out.request_id, run.next_index - 1, out.outputs, out.finished,
                                      out.num_cached_tokens, out.prompt_logprobs, out.embedding)

    def row(self, handle: RequestHandle, kind: EventKind, **fields: Any) -> EventRow:
        return event_row(handle.request_id, ReplyEvent(kind, self._engine_id, self._incarnation, **fields))

    def counted(self, run: Run, kind: EventKind, **fields: Any) -> EventRow:
        """An OUTPUT or ERROR event, numbered in its request's sequence."""
        row = self.row(run.handle, kind, index=run.next_index, **fields)
        run.next_index += 1
        return row

    def _final_events(self, request_ids: list[str], kind: EventKind, **fields: Any) -> list[Reply]:
        runs = [self.owned.pop(rid) for rid in request_ids]
        return [(run.handle, self.counted(run, kind, finished=True, **fields)) for run in runs]
