"""Resuming a stream (SSE ``Last-Event-ID``): a client that lost its connection asks again on any gateway,
re-sending its POST with the header (what client libraries do) or at GET /v1/streams/{id}. The broker replays
the request's events from the first, a fresh assembler makes the same SSE events of them, and those after the
last one the client saw go out before the live ones."""
from __future__ import annotations

import re
import time
import uuid

from aiohttp import web

from service.broker_api import Resumed
from service.errors import APIError, BrokerUnavailable
from service.protocol import GenerationRequest, parse_chat, parse_completion, parse_json
from service.server_errors import unavailable
from service.streaming import Run, Serving, assembler_for, serve_runs
from service.tenancy import Tenancy

# What this gateway names requests (``new_request_id``); a resume naming anything else is unknown without a lookup.
_REQUEST_ID = re.compile(r"(?:chatcmpl|cmpl)-[0-9a-f]{32}", re.ASCII)
_EVENT_ID = re.compile(rf"({_REQUEST_ID.pattern}):([0-9]{{1,9}})", re.ASCII)


def new_request_id(req: GenerationRequest) -> str:
    """``embd-`` for an embedding: no stream of it resumes (``_REQUEST_ID`` names it unknown)."""
    kind = "embd" if req.pooling is not None else "chatcmpl" if req.chat else "cmpl"
    return f"{kind}-{uuid.uuid4().hex}"


def parse_event_id(value: str) -> tuple[str, int]:
    """``<request id>:<k>`` (an SSE event id of this server) as its parts; anything else (another shape of
    id, a number of more than 9 ASCII digits) is the client's mistake."""
    match = _EVENT_ID.fullmatch(value.strip())
    if match is None:
        raise APIError(400, "Last-Event-ID must be '<request id>:<event number>', as sent in the stream's "
                            "'id:' fields", code="invalid_last_event_id")
    return match[1], int(match[2])


class Resumes:
    def __init__(self, serving: Serving, tenancy: Tenancy) -> None:
        self._serving = serving
        self._tenancy = tenancy

    async def stream(self, http: web.Request) -> web.StreamResponse:
        """GET /v1/streams/{request_id}: the whole stream, or with Last-Event-ID the rest of it."""
        request_id = http.match_info["request_id"]
        seen = -1
        if (last := http.headers.get("Last-Event-ID")) is not None:
            last_id, seen = parse_event_id(last)
            if last_id != request_id:
                raise APIError(400, "Last-Event-ID names another request", code="invalid_last_event_id")
        return await self.resume(http, request_id, seen, time.perf_counter())

    async def resume(self, http: web.Request, request_id: str, seen: int, start: float) -> web.StreamResponse:
        """Replays the stream, sends the events after ``seen``, then continues live. The broker checks the
        tenant before it touches anything: another key's stream is as unknown as one that never existed.
        The resumed run is this call's to end."""
        broker, resumed = self._serving.broker, None
        if _REQUEST_ID.fullmatch(request_id):
            try:
                resumed = await broker.resume(request_id, self._tenancy.tenant_of(http))
            except BrokerUnavailable as exc:
                raise unavailable(str(exc), self._serving.config.retry_after_s) from exc
        if resumed is None:
            raise APIError(404, f"stream {request_id!r} is unknown or past the retention window",
                           code="stream_not_found")
        try:
            run = self._run(http, resumed, seen, start)
        except BaseException:
            broker.release(request_id)
            raise
        try:
            return await serve_runs([run])
        finally:
            run.end()

    def _run(self, http: web.Request, resumed: Resumed, seen: int, start: float) -> Run:
        """The stored body parsed again: the same n, stop strings and formats make the same events."""
        record = resumed.record
        parse = parse_chat if record.request_id.startswith("chatcmpl-") else parse_completion
        req = parse(parse_json(record.body), self._serving.config)
        req.stream = True
        return Run(serving=self._serving, http=http, req=req, request_id=record.request_id,
                   prompt_ids=record.prompt_token_ids,
                   assembler=assembler_for(self._serving.tokenizer, req, record.prompt_token_ids),
                   queue=resumed.queue, start=start, created=record.created, skip_through=seen)
