"""The routes of the APIs translated onto the chat path: Anthropic's Messages (``POST /v1/messages``,
``/v1/messages/count_tokens``) and OpenAI's Responses (``POST /v1/responses``). Each body is translated
(``service.anthropic_api``, ``service.responses_api``), then takes the gateway's one chat path: its checks, its
admission, its run; the run's answer, whole or streamed, is translated back."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from service import anthropic_api, responses_api
from service.errors import APIError
from service.gateway import Gateway
from service.protocol import parse_chat, parse_json, parse_tokenize
from service.streaming import Run, stream_events

ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")

Events = Callable[[Run], AsyncIterator[tuple[str, dict[str, Any]]]]


class TranslatedRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    async def messages(self, http: web.Request) -> web.StreamResponse:
        chat = anthropic_api.to_chat_body(await _body(http))
        return await self._serve(http, chat, _anthropic_events, lambda exc: ("error", anthropic_api.error_body(exc)),
                                 lambda run, answer: anthropic_api.from_chat_body(answer, run.assembler.matched_stop(0)))

    async def count_tokens(self, http: web.Request) -> web.Response:
        body = anthropic_api.count_tokens_body(await _body(http))
        ids = await self._gateway.token_ids(http, parse_tokenize(body))
        return web.json_response({"input_tokens": len(ids)})

    async def responses(self, http: web.Request) -> web.StreamResponse:
        body = await _body(http)
        return await self._serve(http, responses_api.to_chat_body(body), lambda run: _response_events(run, body),
                                 lambda exc: ("error", _responses_error(exc)),
                                 lambda run, whole: responses_api.from_chat_body(whole, _envelope(run, body)))

    async def _serve(self, http: web.Request, chat: dict[str, Any], events: Events,
                     error_event: Callable[[APIError], tuple[str, dict[str, Any]]],
                     answer: Callable[[Run, dict[str, Any]], dict[str, Any]]) -> web.StreamResponse:
        start, gateway = time.perf_counter(), self._gateway
        req = parse_chat(chat, gateway.config)
        await gateway.check(http, req)
        async with gateway.admitted(http, req, json.dumps(chat).encode(), start) as run:
            if req.stream:
                return await stream_events(run, events(run), error_event)
            whole = await run.guarded(run.complete())
            if whole is None:
                return web.Response(status=499)  # nobody is listening
            return web.json_response(answer(run, whole))


async def _body(http: web.Request) -> dict[str, Any]:
    body = parse_json(await http.read())
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


async def _anthropic_events(run: Run) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    stream = anthropic_api.MessageStream(run.serving.model_name)
    for event in stream.start(run.request_id, len(run.prompt_ids)):
        yield event
    async for chunk in run.chunks():
        for event in stream.feed(chunk):
            yield event
    for event in stream.end(run.assembler.matched_stop(0), run.usage()["completion_tokens"]):
        yield event


def _envelope(run: Run, body: dict[str, Any]) -> responses_api.Envelope:
    return responses_api.Envelope(run.request_id, run.serving.model_name, body, run.created)


async def _response_events(run: Run, body: dict[str, Any]) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    stream = responses_api.ResponseStream(_envelope(run, body))
    for event in stream.start():
        yield event
    async for chunk in run.chunks():
        for event in stream.feed(chunk):
            yield event
    for event in stream.end(run.usage()):
        yield event


def _responses_error(exc: APIError) -> dict[str, Any]:
    """An error after the stream started, as the Responses API's ``error`` event."""
    return {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param, "sequence_number": 0}
