"""A request in flight turned into its HTTP response: the broker's reply events detokenized (on the tokenizer
threads) into one JSON body, or into server-sent events framed as OpenAI frames them; a client that asks
(``X-Resumable: 1``) also gets an ``id: <request id>:<k>`` line per event, so that it can resume after losing
its connection (``service.resume``). One response may carry several runs (a list of prompts).

A run only reports how it ended (the engine finished it, its client left, another connection took it over);
whoever made it, the admission or a resume, ends it with ``Run.end``."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from service import responses
from service.assembler import ChoiceUpdate, OutputAssembler
from service.broker_api import HANDED_OVER_STATUS, GatewayBroker
from service.config import GatewayConfig
from service.errors import APIError
from service.messages import EventKind, ReplyEvent
from service.metrics import GatewayMetrics
from service.protocol import GenerationRequest
from service.reasoning import reasoning_stream
from service.server_errors import internal_error, unavailable
from service.tokenizer_threads import TokenizerThreads
from service.tool_parsers import ForcedCallParser, MessageStream, ToolCallStream, make_parser, merge

T = TypeVar("T")
# A choice's update with its logprobs in the endpoint's shape (None when not asked for or none came).
Update = tuple[ChoiceUpdate, dict[str, Any] | None]


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


@dataclass(slots=True)
class Serving:
    """What every run of one gateway shares."""

    config: GatewayConfig
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    broker: GatewayBroker
    metrics: GatewayMetrics
    threads: TokenizerThreads


def assembler_for(tokenizer: PreTrainedTokenizerBase, req: GenerationRequest, prompt_ids: list[int]) -> OutputAssembler:
    """The detokenizers of the request's choices (each decodes the prompt's tail) and its stop strings."""
    return OutputAssembler(tokenizer=tokenizer, prompt_token_ids=prompt_ids, n=req.params.n, stop=req.stop,
                           include_stop=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens)


class Run:
    """One engine request in flight: turns its reply events into an HTTP response. A resumed one
    (``skip_through`` set) gets every event from the first and sends the SSE events after ``skip_through``."""

    def __init__(self, serving: Serving, http: web.Request, req: GenerationRequest, request_id: str,
                 prompt_ids: list[int], assembler: OutputAssembler, queue: asyncio.Queue[ReplyEvent],
                 start: float, created: int, skip_through: int | None = None) -> None:
        self.serving, self.http, self.req, self.request_id = serving, http, req, request_id
        self.prompt_ids = prompt_ids
        self.queue = queue
        self.assembler = assembler
        self.logprobs = responses.LogprobFormatter(serving.tokenizer, req.params.logprobs or 0)
        self.text_offsets = [0] * req.params.n  # per choice: where its next token's text starts (completions)
        self.created = created
        self.skip_through = skip_through
        self.start = start  # when the HTTP request arrived: TTFT includes validation and tokenizing
        self.last_token_time: float | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[Any] | None = None  # the engine's, from the first event that has them
        self.embedding: bytes | None = None  # an embedding request's vector, from its final event
        self.engine_done = False
        self.client_gone = False
        self.handed_over = False  # its subscription went to a newer connection (or was lost): not its to end
        # A streamed chat choice's parsers (reasoning, tool calls); a whole response parses each choice at its end.
        self.messages = [self._message_stream(i) for i in range(req.params.n)] if req.chat and req.stream else []

    def end(self) -> None:
        """Tells the broker how the run ended: the abort, unless the engine already ended the request or
        another connection took the stream over; a stream whose client hung up is left running a while for
        the client to resume it. Its owner (the admission, or a resume) calls it, once."""
        if self.handed_over:
            return
        broker = self.serving.broker
        if self.engine_done:
            broker.release(self.request_id)
        elif self.client_gone and self.req.stream:
            broker.detach(self.request_id)
        else:
            broker.abort_later(self.request_id)

    async def guarded(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, None when the client went away."""
        try:
            return await work
        except ClientGone:
            self.client_gone = True
            return None
        except asyncio.CancelledError:  # aiohttp cancels a handler whose client hung up (or at shutdown)
            self.client_gone = True
            raise

    async def updates(self) -> AsyncIterator[list[Update]]:
        """Each hop takes every event waiting, so a busy stream pays one trip to the tokenizer threads
        for all its pending deltas, in order."""
        while not self.assembler.finished:
            events = await self._next_events()
            outputs = [e for e in events if e.kind is EventKind.OUTPUT]
            for event in outputs:
                self._observe(event)
            if outputs:
                updates = await self.serving.threads.run(self.http, self._apply, outputs)
                if any(e.finished for e in outputs):
                    self.engine_done = True
                elif self.assembler.finished:
                    self.serving.broker.abort_later(self.request_id)  # a stop string ended it: free its blocks now
                    self.engine_done = True
                yield updates
            if events[-1].kind is EventKind.ERROR and not self.assembler.finished:
                self.engine_done = bool(events[-1].engine_id)  # "": the gateway's own (a deadline, a gap)
                self.handed_over = events[-1].status == HANDED_OVER_STATUS and not events[-1].engine_id
                raise self._engine_error(events[-1])
        self._record_finish()

    def _apply(self, events: list[ReplyEvent]) -> list[Update]:
        """Detokenizes and applies stop strings (on the tokenizer threads); each update with its logprobs
        in the endpoint's shape."""
        updates: list[Update] = []
        for event in events:
            if self.assembler.finished:
                break
            step = self.assembler.apply(event.choices)
            if event.finished:
                step += self.assembler.finish_all("abort")
            updates += [(u, self._logprobs(u)) for u in step]
        return updates

    async def _next_events(self) -> list[ReplyEvent]:
        """The next event and those already queued behind it, up to the first that ends the request."""
        events = [await self._next_event()]
        while not (events[-1].finished or events[-1].kind is EventKind.ERROR or self.queue.empty()):
            events.append(self.queue.get_nowait())
        return events

    def _engine_error(self, event: ReplyEvent) -> APIError:
        if event.status == 500:  # a fault of the engine: its text stays in the logs
            return internal_error(f"engine {event.engine_id} failed {self.request_id}: {event.error}",
                                  self.request_id, code="engine_error", with_traceback=False)
        if event.status == 503:
            return unavailable(event.error or "no engine could serve this request", self.serving.config.retry_after_s)
        if self.handed_over:
            return APIError(event.status, event.error, code="stream_taken_over")
        return APIError(event.status, event.error or "the engine failed this request",
                        code="engine_error" if event.status >= 500 else None)

    async def _next_event(self) -> ReplyEvent:
        """Waits no longer than the client stays, nor than the broker keeps this run subscribed (a stream
        whose subscription went away ends with an error, never hangs)."""
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), self.serving.config.engine_poll_s)
            except asyncio.TimeoutError:
                transport = self.http.transport
                if transport is None or transport.is_closing():
                    raise ClientGone() from None
                if self.queue.empty() and not self.serving.broker.subscribed(self.request_id, self.queue):
                    return ReplyEvent(EventKind.ERROR, "", finished=True, status=HANDED_OVER_STATUS,
                                      error="this stream lost its subscription; resume it (Last-Event-ID)")

    def _observe(self, event: ReplyEvent) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.embedding is not None:
            self.embedding = event.embedding
        if self.skip_through is not None or not any(c.token_ids for c in event.choices):  # a replay: no latency
            return
        now = time.perf_counter()
        if self.last_token_time is None:
            self.serving.metrics.model_ttft.observe(now - self.start)
        else:
            self.serving.metrics.model_itl.observe(now - self.last_token_time)
        self.last_token_time = now

    def _record_finish(self) -> None:
        metrics, name = self.serving.metrics, self.serving.model_name
        metrics.e2e.labels(name).observe(time.perf_counter() - self.start)
        for index in range(self.req.params.n):
            metrics.success.labels(name, self.assembler.finish_reason(index)).inc()

    def usage(self) -> dict[str, Any]:
        completion_tokens = 0 if self.req.echo_only else self.assembler.num_completion_tokens
        return responses.usage(len(self.prompt_ids), completion_tokens, self.num_cached_tokens)

    # ---- non-streaming ----------------------------------------------------
    async def pooled(self) -> bytes:
        """An embedding request's vector (float32, little-endian), once the engine finished it."""
        async for _ in self.updates():
            pass
        if self.embedding is None:  # the engine aborted it (no error event came, and no vector)
            raise internal_error(f"{self.request_id} ended without its embedding", self.request_id,
                                 with_traceback=False)
        return self.embedding

    async def complete(self) -> dict[str, Any]:
        """The whole response body."""
        lp_parts: list[list[dict[str, Any]]] = [[] for _ in range(self.req.params.n)]
        async for updates in self.updates():
            for u, logprobs in updates:
                if logprobs is not None:
                    lp_parts[u.index].append(logprobs)
        choices = [self._final_choice(i, parts) for i, parts in enumerate(lp_parts)]
        if self.req.echo or self.req.prompt_logprobs is not None:
            await self.serving.threads.run(self.http, self._add_prompt_parts, choices)
        obj = "chat.completion" if self.req.chat else "text_completion"
        return responses.envelope(self.request_id, obj, self.created, self.serving.model_name, choices, self.usage())

    def _add_prompt_parts(self, choices: list[dict[str, Any]]) -> None:
        """echo (the prompt's text, and with logprobs its tokens' logprobs, before each choice's) and vLLM's
        per-choice prompt_logprobs; on the tokenizer threads (a decode per prompt token)."""
        entries = self.prompt_logprobs or [None] * len(self.prompt_ids)
        if self.req.prompt_logprobs is not None:
            listed = self.logprobs.prompt_logprobs(entries, self.req.prompt_logprobs)
            for choice in choices:
                choice["prompt_logprobs"] = listed
        if self.req.echo:
            prompt = self.req.prompt
            text = prompt if isinstance(prompt, str) else self.serving.tokenizer.decode(self.prompt_ids)
            head = self.logprobs.prompt_completion(self.prompt_ids, entries) if self.req.want_logprobs else None
            for choice in choices:
                responses.prepend_echo(choice, text, head, self.req.echo_only)

    def _final_choice(self, index: int, parts: list[dict[str, Any]]) -> dict[str, Any]:
        text, reason = self.assembler.text(index), self.assembler.finish_reason(index)
        if self.req.chat:
            logprobs = {"content": [e for p in parts for e in p["content"]]} if self.req.want_logprobs else None
            stream = self._message_stream(index)
            message = merge(stream.feed(text, final=True)) if stream is not None else {"content": text}
            return responses.chat_choice(index, message, logprobs, reason)
        logprobs = responses.LogprobFormatter.merge_completion(parts) if self.req.want_logprobs else None
        return responses.completion_choice(index, text, logprobs, reason)

    # ---- streaming --------------------------------------------------------
    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks, the usage chunk aside (``stream_runs`` sends it, summed over the runs)."""
        if self.req.chat:
            roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(self.req.params.n)]
            yield self.chunk(roles)
        async for updates in self.updates():
            for u, logprobs in updates:
                if u.text or u.finish_reason or logprobs is not None:
                    for choice in self._chunk_choices(u, logprobs):
                        yield self.chunk([choice])

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.req.chat else "text_completion"
        return responses.envelope(self.request_id, obj, self.created, self.serving.model_name, choices, usage,
                                  with_usage=self.req.include_usage)

    def _chunk_choices(self, u: ChoiceUpdate, logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The update's chunk choices: one, or for a parsed chat choice one per delta part (none while the
        parsers hold its text back); logprobs go with the first, the finish reason with the last."""
        if not self.req.chat:
            return [responses.completion_choice(u.index, u.text, logprobs, u.finish_reason)]
        stream = self.messages[u.index]
        if stream is None:
            return [responses.chat_chunk_choice(u, logprobs)]
        deltas = stream.feed(u.text, final=u.finish_reason is not None)
        if not deltas and (u.finish_reason or logprobs is not None):
            deltas = [{}]
        last = len(deltas) - 1
        return [responses.chat_delta_choice(u.index, d, logprobs if k == 0 else None,
                                            u.finish_reason if k == last else None, stream.num_calls > 0)
                for k, d in enumerate(deltas)]

    def _message_stream(self, index: int) -> MessageStream | None:
        """A chat choice's parsers: reasoning (--reasoning-parser), then tool calls (a forced call's JSON, or
        --tool-call-parser's format for tool_choice "auto"); None when neither applies."""
        tools, parser, config = self.req.tools, None, self.serving.config
        if tools is not None and tools.forced:
            parser = ForcedCallParser(tools.name)
        elif tools is not None and tools.choice == "auto":
            parser = make_parser(config.tool_call_parser, tools.tools)
        name = config.reasoning_parser
        thinking = self.req.chat_template_kwargs.get("enable_thinking", True) is not False
        reasoning = reasoning_stream(name, thinking) if name else None
        if parser is None and reasoning is None:
            return None
        calls = ToolCallStream(parser, f"{self.request_id}:{index}") if parser is not None else None
        return MessageStream(calls, reasoning)

    def _logprobs(self, u: ChoiceUpdate) -> dict[str, Any] | None:
        """This update's logprobs in the endpoint's shape; None when not asked for or none came."""
        if not (self.req.want_logprobs and u.logprobs):
            return None
        if self.req.chat:
            return self.logprobs.chat(u)
        # vLLM's offsets: the tokens' texts laid end to end. Not the text sent so far, which a stop string's
        # hold-back delays and a speculative step sends several tokens at once.
        body = self.logprobs.completion(u, self.text_offsets[u.index])
        self.text_offsets[u.index] = body["text_offset"][-1] + len(body["tokens"][-1])
        return body


async def serve_runs(runs: list[Run]) -> web.StreamResponse:
    """The response to one HTTP request: its one run, or one run per prompt of a list (choice i of prompt k
    is choice k * n + i, usage summed)."""
    if runs[0].req.stream:
        return await stream_runs(runs)
    bodies = await gather_runs(runs, Run.complete)
    if bodies is None:
        return web.Response(status=499)  # nobody is listening; nginx's "client closed request"
    return web.json_response(responses.merge_prompts(bodies, runs[0].req.params.n))


async def gather_runs(runs: list[Run], work: Callable[[Run], Awaitable[T]]) -> list[T] | None:
    """``work`` of every run at once; None when the client went away."""
    tasks = [asyncio.ensure_future(run.guarded(work(run))) for run in runs]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()  # an engine error in one prompt fails the response: the others stop too
        raise
    return None if any(result is None for result in results) else results


async def stream_runs(runs: list[Run]) -> web.StreamResponse:
    """One SSE stream: the runs' chunks one run after the other (the engine runs them all at once; the
    later ones' events wait in their queues), then the summed usage, then ``data: [DONE]``."""
    first = runs[0]
    sse = _SSEWriter(_sse_response(first), first.request_id,
                     -1 if first.skip_through is None else first.skip_through, _wants_event_ids(first))
    return await _serve_events(runs, sse, _chunks_of(runs), lambda exc: (None, exc.body()), done_marker=True)


async def stream_events(run: Run, events: AsyncIterator[tuple[str, dict[str, Any]]],
                        error_event: Callable[[APIError], tuple[str, dict[str, Any]]]) -> web.StreamResponse:
    """One run's stream in another API's shape: ``events`` (made of its chunks) are named SSE events (``event:``
    then ``data:``), an error after the 200 is that API's error event, and no ``[DONE]`` ends it."""
    sse = _SSEWriter(_sse_response(run), run.request_id, -1, False)
    return await _serve_events([run], sse, events, error_event, done_marker=False)


async def _chunks_of(runs: list[Run]) -> AsyncIterator[tuple[str | None, dict[str, Any]]]:
    first = runs[0]
    for k, run in enumerate(runs):
        async for chunk in run.chunks():
            chunk["id"] = first.request_id
            for choice in chunk["choices"]:
                choice["index"] += k * run.req.params.n
            yield None, chunk
    if first.req.include_usage:
        yield None, first.chunk([], responses.sum_usage([run.usage() for run in runs]))


async def _serve_events(runs: list[Run], sse: _SSEWriter, events: AsyncIterator[tuple[str | None, dict[str, Any]]],
                        error_event: Callable[[APIError], tuple[str | None, dict[str, Any]]],
                        done_marker: bool) -> web.StreamResponse:
    first = runs[0]
    try:
        # Validation is done and the requests are queued, so the 200 can go out now.
        await sse.start(first.http, first.serving.config.sse_keepalive_s)
        async for name, body in events:
            await sse.send(body, name)
    except APIError as exc:
        name, body = error_event(exc)
        await sse.send(body, name)
    except (ClientGone, ConnectionResetError):
        _client_gone(runs)
        sse.stop()
        return sse.response
    except asyncio.CancelledError:  # aiohttp cancels a handler whose client hung up (or at shutdown)
        _client_gone(runs)
        sse.stop()
        raise
    except Exception:  # the 200 is out: the error can only be the stream's last event
        name, body = error_event(internal_error(f"stream of {first.request_id} failed", first.request_id))
        await sse.send(body, name)
    await sse.done(done_marker)
    return sse.response


def _sse_response(run: Run) -> web.StreamResponse:
    """The stream's headers. ``X-Request-Id`` is the resume token without ``id:`` lines: the k-th ``data:``
    event (from 0) is ``<request id>:<k>`` for Last-Event-ID."""
    return web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no", "X-Request-Id": run.request_id})


def _wants_event_ids(run: Run) -> bool:
    """``id:`` lines only when asked for (OpenAI sends none, and clients that split events on blank lines and
    strip ``data: `` cannot parse them): the server flag, ``X-Resumable: 1``, or a resume (its client resumes)."""
    asked = run.http.headers.get("X-Resumable", "").strip().lower() in ("1", "true")
    return run.serving.config.sse_event_ids or asked or run.skip_through is not None


def _client_gone(runs: list[Run]) -> None:
    for run in runs:
        run.client_gone = True


class _SSEWriter:
    """``data: <json>`` per event (with ``event_ids``, an ``id: <request id>:<k>`` line before it; k counts the
    events from 0), ``data: [DONE]`` last; the events up to ``skip_through`` (those a resuming client has) are
    counted, not sent. While no event flows for ``keepalive_s``, a ``: keep-alive`` comment goes out (clients
    ignore comments; proxies see traffic)."""

    def __init__(self, response: web.StreamResponse, request_id: str, skip_through: int, event_ids: bool) -> None:
        self.response = response
        self.request_id = request_id
        self.skip_through = skip_through
        self.event_ids = event_ids
        self._next_id = 0
        self._lock = asyncio.Lock()  # one write at a time: events and keep-alives
        self._written_at = time.monotonic()
        self._keepalive: asyncio.Task | None = None

    async def start(self, http: web.Request, keepalive_s: float) -> None:
        await self.response.prepare(http)
        if keepalive_s > 0:
            self._keepalive = asyncio.create_task(self._keep_alive(keepalive_s))

    async def send(self, body: dict[str, Any], event: str | None = None) -> None:
        await self._write(json.dumps(body, separators=(",", ":"), ensure_ascii=False), event)

    async def done(self, marker: bool = True) -> None:
        if marker:
            await self._write("[DONE]")
        self.stop()
        await self.response.write_eof()

    def stop(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()

    async def _write(self, data: str, event: str | None = None) -> None:
        k, self._next_id = self._next_id, self._next_id + 1
        if k > self.skip_through:
            event_id = f"id: {self.request_id}:{k}\n" if self.event_ids else ""
            name = f"event: {event}\n" if event else ""
            await self._send(f"{event_id}{name}data: {data}\n\n".encode("utf-8"))

    async def _send(self, payload: bytes) -> None:
        async with self._lock:
            await self.response.write(payload)
            self._written_at = time.monotonic()

    async def _keep_alive(self, interval_s: float) -> None:
        try:
            while True:
                await asyncio.sleep(self._written_at + interval_s - time.monotonic())
                if time.monotonic() - self._written_at >= interval_s:
                    await self._send(b": keep-alive\n\n")
        except (ConnectionResetError, RuntimeError):  # the client left: the stream's own write says so
            return
