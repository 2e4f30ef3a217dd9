"""The routes of the APIs translated onto the chat path: Anthropic's Messages (``POST /v1/messages``,
``/v1/messages/count_tokens``) and OpenAI's Responses (``POST /v1/responses``). Each body is translated
(``service.anthropic_api``, ``service.responses_api``), then takes the gateway's one chat path: its checks, its
admission, its run; the run's answer, whole or streamed, is translated back."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from service import anthropic_api, responses_api
from service.errors import APIError, BrokerUnavailable
from service.gateway import Gateway
from service.messages import StoredResponse
from service.protocol import parse_chat, parse_json, parse_tokenize, require_object
from service.response_store import ResponseStore
from service.server_errors import unavailable
from service.streaming import Run, stream_events

ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")

Events = Callable[[Run], AsyncIterator[tuple[str, dict[str, Any]]]]
T = TypeVar("T")


class TranslatedRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    async def messages(self, http: web.Request) -> web.StreamResponse:
        chat = anthropic_api.to_chat_body(await _body(http))
        async def answer(run: Run, whole: dict[str, Any]) -> dict[str, Any]:
            return anthropic_api.from_chat_body(whole, run.assembler.matched_stop(0))
        return await self._serve(http, chat, _anthropic_events, lambda exc: ("error", anthropic_api.error_body(exc)),
                                 answer)

    async def count_tokens(self, http: web.Request) -> web.Response:
        body = anthropic_api.count_tokens_body(await _body(http))
        ids = await self._gateway.token_ids(http, parse_tokenize(body))
        return web.json_response({"input_tokens": len(ids)})

    async def responses(self, http: web.Request) -> web.StreamResponse:
        body = await _body(http)
        tenant = self._gateway.tenancy.tenant_of(http)
        previous = await self._previous(body.get("previous_response_id"), tenant)
        chat = responses_api.to_chat_body(body, previous)

        async def keep(response: dict[str, Any]) -> None:
            if response["store"]:
                await self._keep(response, responses_api.conversation(chat, body, response), tenant)

        async def answer(run: Run, whole: dict[str, Any]) -> dict[str, Any]:
            response = responses_api.from_chat_body(whole, _envelope(run, body))
            await keep(response)
            return response
        return await self._serve(http, chat, lambda run: _response_events(run, body, keep),
                                 lambda exc: ("error", _responses_error(exc)), answer)

    async def get_response(self, http: web.Request) -> web.Response:
        return web.json_response(json.loads((await self._stored(http)).response))

    async def delete_response(self, http: web.Request) -> web.Response:
        response_id = http.match_info["response_id"]
        if not await self._store_call(self._store().delete(response_id, self._gateway.tenancy.tenant_of(http))):
            raise _not_found(response_id)
        return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel_response(self, http: web.Request) -> web.Response:
        await self._stored(http)
        raise APIError(400, "only background responses can be cancelled, and this server runs none",
                       param="response_id")

    async def _previous(self, response_id: Any, tenant: str) -> list[dict[str, Any]] | None:
        if response_id is None:
            return None
        if not isinstance(response_id, str):
            raise APIError(400, "previous_response_id must be a string", param="previous_response_id")
        stored = await self._store_call(self._store().get(response_id, tenant))
        if stored is None:
            raise APIError(404, f"response {response_id!r} is unknown, another API key's or past --response-ttl",
                           param="previous_response_id", code="response_not_found")
        return json.loads(stored.conversation)

    async def _stored(self, http: web.Request) -> StoredResponse:
        response_id = http.match_info["response_id"]
        stored = await self._store_call(self._store().get(response_id, self._gateway.tenancy.tenant_of(http)))
        if stored is None:
            raise _not_found(response_id)
        return stored

    async def _keep(self, response: dict[str, Any], conversation: list[dict[str, Any]], tenant: str) -> None:
        stored = StoredResponse(response_id=response["id"], tenant=tenant, response=json.dumps(response).encode(),
                                conversation=json.dumps(conversation).encode())
        await self._store_call(self._store().put(stored, self._gateway.config.response_ttl_s))

    def _store(self) -> ResponseStore:
        return self._gateway.broker.responses()

    async def _store_call(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except BrokerUnavailable as exc:
            raise unavailable(str(exc), self._gateway.config.retry_after_s) from exc

    async def _serve(self, http: web.Request, chat: dict[str, Any], events: Events,
                     error_event: Callable[[APIError], tuple[str, dict[str, Any]]],
                     answer: Callable[[Run, dict[str, Any]], Awaitable[dict[str, Any]]]) -> web.StreamResponse:
        start, gateway = time.perf_counter(), self._gateway
        req = parse_chat(chat, gateway.config)
        await gateway.check(http, req)
        async with gateway.admitted(http, req, json.dumps(chat).encode(), start) as run:
            if req.stream:
                return await stream_events(run, events(run), error_event)
            whole = await run.guarded(run.complete())
            if whole is None:
                return web.Response(status=499)  # nobody is listening
            return web.json_response(await answer(run, whole))


async def _body(http: web.Request) -> dict[str, Any]:
    return require_object(parse_json(await http.read()))


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


async def _response_events(run: Run, body: dict[str, Any], keep: Callable[[dict[str, Any]], Awaitable[None]]
                           ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The Responses events of a run; the final response is kept (``keep``) before its event goes out."""
    stream = responses_api.ResponseStream(_envelope(run, body))
    for event in stream.start():
        yield event
    try:
        async for chunk in run.chunks():
            for event in stream.feed(chunk):
                yield event
    except APIError as exc:
        yield stream.error(exc.code, exc.message, exc.param)
        return
    for name, event in stream.end(run.usage()):
        if name in ("response.completed", "response.incomplete"):
            await keep(event["response"])
        yield name, event


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} is unknown, another API key's or past --response-ttl",
                    param="response_id", code="response_not_found")


def _responses_error(exc: APIError) -> dict[str, Any]:
    """A stream that failed outside its run's chunks (before its first event, or inside the gateway), as the
    Responses API's ``error`` event; one failing mid-run is numbered by its stream (``ResponseStream.error``)."""
    return {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param, "sequence_number": 0}
