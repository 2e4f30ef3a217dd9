"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API): the body translated
(``service.anthropic_api``), then the gateway's one chat path: its checks, its admission, its run."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from service.anthropic_api import MessageStream, count_tokens_body, error_body, from_chat_body, to_chat_body
from service.errors import APIError
from service.gateway import Gateway
from service.protocol import parse_chat, parse_json, parse_tokenize
from service.streaming import Run, stream_events

PATHS = ("/v1/messages", "/v1/messages/count_tokens")


class MessagesRoute:
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    async def create(self, http: web.Request) -> web.StreamResponse:
        start, gateway = time.perf_counter(), self._gateway
        chat = to_chat_body(_object(parse_json(await http.read())))
        req = parse_chat(chat, gateway.config)
        await gateway.check(http, req)
        async with gateway.admitted(http, req, json.dumps(chat).encode(), start) as run:
            if req.stream:
                return await stream_events(run, _events(run), lambda exc: ("error", error_body(exc)))
            answer = await run.guarded(run.complete())
            if answer is None:
                return web.Response(status=499)  # nobody is listening
            return web.json_response(from_chat_body(answer, run.assembler.matched_stop(0)))

    async def count_tokens(self, http: web.Request) -> web.Response:
        body = count_tokens_body(_object(parse_json(await http.read())))
        ids = await self._gateway.token_ids(http, parse_tokenize(body))
        return web.json_response({"input_tokens": len(ids)})


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


async def _events(run: Run) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    stream = MessageStream(run.serving.model_name)
    for event in stream.start(run.request_id, len(run.prompt_ids)):
        yield event
    async for chunk in run.chunks():
        for event in stream.feed(chunk):
            yield event
    for event in stream.end(run.assembler.matched_stop(0), run.usage()["completion_tokens"]):
        yield event
