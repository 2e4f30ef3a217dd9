"""The OpenAI-compatible HTTP gateway (aiohttp): validate, tokenize, submit to
the broker, detokenize the engine's tokens and answer, streaming or not.
The broker is given (Redis in deployments, ``service.memory_broker`` in unit tests)."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

from aiohttp import web
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from engine.structured_output import check_structured_output

from service import dashboard, responses
from service.assembler import ChoiceUpdate, OutputAssembler
from service.broker_api import HANDED_OVER_STATUS, BrokerUnavailable, GatewayBroker, Resumed
from service.fair_pool import FairPool, PoolFull
from service.limits import KeyLimits
from service.config import GatewayConfig
from service.connections import BodyTimeout, track_requests
from service.messages import EventKind, ReplyEvent, RequestMsg, StreamRecord, params_to_wire
from service.metrics import CONTENT_TYPE, GatewayMetrics
from service.openapi import PUBLIC_PATHS, openapi_document
from service.protocol import (APIError, GenerationRequest, TokenizeRequest, check_context, parse_chat, parse_completion,
                              parse_detokenize, parse_json, parse_tokenize)
from service.reasoning import ReasoningStream
from service.tokenization import encode_chat, encode_prompt, template_chars_per_message
from service.tool_parsers import PARSERS, ForcedCallParser, MessageStream, ToolCallStream, merge
from service.tools import ToolRequest, check_tool_parser

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")
_API_KEY = web.RequestKey("api_key", str)  # the key a request authenticated with
# Keys the tenant HMAC stored with each stream (StreamRecord.tenant): the same on every gateway, so any of
# them can check a resuming client; API keys are long random secrets, so the digest does not reveal them.
_TENANT_KEY = b"pagedserve stream tenant"
# What this gateway names requests (``_admitted``); a resume naming anything else is unknown without a lookup.
_REQUEST_ID = re.compile(r"(?:chatcmpl|cmpl)-[0-9a-f]{32}", re.ASCII)
_EVENT_ID = re.compile(rf"({_REQUEST_ID.pattern}):([0-9]{{1,9}})", re.ASCII)


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: PreTrainedTokenizerBase, model_name: str,
                 max_model_len: int, broker: GatewayBroker) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.broker = broker
        self.gateway_id = broker.gateway_id
        self.metrics = GatewayMetrics(model_name, lambda: self.broker.engines)
        self.created = int(time.time())
        self._salt_secret = (config.prefix_cache_secret or secrets.token_hex(32)).encode()
        policies, default = config.policies()
        self.limits = KeyLimits(policies, default, config.retry_after_s,
                                lambda: broker.limiter(config.limit_lease_s))
        # Tokenizing a long prompt takes milliseconds, detokenizing a busy server's streams as much: neither
        # runs on the event loop, which must keep answering, and each tenant gets its turn at the threads.
        # One tenant's queue is bounded like the engines' (429 past max_pending_requests).
        threads = config.tokenizer_threads or (2 if tokenizer.is_fast else 1)
        self._tokenizer_pool = FairPool(threads, config.max_pending_requests)
        # Characters the chat template adds per message: empty messages must count against the cap too.
        self._chars_per_message = template_chars_per_message(tokenizer)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[track_requests, self._cors, self._errors, self._auth])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/streams/{request_id}", self.resume_stream)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/v1/kv_snapshot", self.kv_snapshot)
        for path in dashboard.PAGES:
            app.router.add_get(path, self.dashboard_page)
        app.on_startup.append(lambda _: self.broker.start())
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, _: web.Application) -> None:
        await self.broker.close()
        self._tokenizer_pool.shutdown()

    # ---- middlewares ------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as exc:
            return self._error_response(exc)
        except BodyTimeout as exc:  # the body trickled in too slowly: the connection closes after this
            return self._error_response(APIError(408, str(exc), code="request_timeout",
                                                 headers={"Connection": "close"}))
        except web.HTTPException as exc:  # routing errors, 413 from aiohttp's body limit
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None  # a 405's methods
            return self._error_response(APIError(exc.status, exc.text or exc.reason, code=code, headers=allow))
        except Exception:
            return self._error_response(internal_error(f"unhandled error on {request.path}"))

    def _error_response(self, exc: APIError) -> web.Response:
        self.metrics.errors.labels(str(exc.status)).inc()
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers)

    @web.middleware
    async def _cors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        allowed = origin is not None and ("*" in self.config.cors_origins or origin in self.config.cors_origins)
        if request.method == "OPTIONS" and allowed:
            response: web.StreamResponse = web.Response(status=204)
        else:
            response = await handler(request)
        if allowed and not response.prepared:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Vary"] = "Origin"
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.config.all_keys and request.path not in PUBLIC_PATHS:
            request[_API_KEY] = self._matching_key(request)
            if request[_API_KEY] is None:
                raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
            if request.path == "/metrics" and self.config.admin_keys and not self._is_admin(request):
                raise APIError(403, "the metrics are totals over every tenant: they need an admin key",
                               code="admin_key_required")
        return await handler(request)

    def _is_admin(self, request: web.Request) -> bool:
        """An admin key sees every tenant (without keys there are no tenants to keep apart)."""
        return not self.config.all_keys or request.get(_API_KEY) in self.config.admin_keys

    def _matching_key(self, request: web.Request) -> str | None:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        try:
            given_bytes = given.strip().encode()
        except UnicodeEncodeError:  # undecodable header bytes (surrogates): no key matches them
            return None
        match = None
        for key in self.config.all_keys:  # no early exit: time does not depend on which key matched
            if hmac.compare_digest(given_bytes, key.encode()):
                match = key
        return match if scheme.lower() == "bearer" else None

    def _cache_salt(self, http: web.Request, request_salt: str | None) -> str:
        """The tenant's salt, HMAC(server secret, API key), then the request's own: two keys never share
        (nor, through ``cached_tokens``, reveal) prefix-cache blocks; one key shares across its requests."""
        tenant = hmac.new(self._salt_secret, http.get(_API_KEY, "").encode(), hashlib.sha256).hexdigest()
        return tenant + (request_salt or "")  # fixed-length tenant part: the two cannot run into each other

    # ---- simple routes ----------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _: web.Request) -> web.Response:
        problem = self._unavailable_reason()
        if problem:
            return web.json_response({"status": "unavailable", "reason": problem}, status=503)
        return web.json_response({"status": "ready", "engines": len(self._live_engines())})

    async def models(self, _: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                "root": self.model_name, "max_model_len": self._context_len()}
        return web.json_response({"object": "list", "data": [card]})

    async def metrics_text(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi(self, _: web.Request) -> web.Response:
        return web.json_response(openapi_document(self.model_name, self.config))

    async def dashboard_page(self, http: web.Request) -> web.Response:
        body, content_type = dashboard.page(http.path)
        return web.Response(body=body, content_type=content_type, headers=dashboard.PAGE_HEADERS)

    async def kv_snapshot(self, http: web.Request) -> web.Response:
        """An engine's latest KV snapshot (the first live one's unless ``?engine=``); asking is what makes
        the engine publish them, so the first answer may hold none yet (``snapshot``: null)."""
        engines = sorted(self._live_engines())
        if not engines:
            raise unavailable(f"no live engine serves model {self.model_name!r}", self.config.retry_after_s)
        engine_id = http.query.get("engine") or engines[0]
        if engine_id not in engines:
            raise APIError(404, f"no live engine {engine_id!r} serves model {self.model_name!r}", param="engine",
                           code="engine_not_found")
        try:
            payload = await self.broker.kv_snapshot(engine_id)
        except BrokerUnavailable as exc:
            raise unavailable(str(exc), self.config.retry_after_s) from exc
        viewer = None if self._is_admin(http) else self.tenant_of(http)
        snapshot = await self.off_loop(http, dashboard.snapshot_json, payload, time.time(), viewer)
        response = web.json_response({"object": "kv_snapshot", "engines": engines, "engine": engine_id,
                                      "snapshot": snapshot})
        response.enable_compression()
        return response

    def _live_engines(self) -> dict[str, Any]:
        return {i: b for i, b in self.broker.engines.items() if b.model == self.model_name}

    def _context_len(self) -> int:
        # The engines' limit wins when it is tighter than what the checkpoint says.
        return min([self.max_model_len] + [b.max_model_len for b in self._live_engines().values()])

    def _unavailable_reason(self) -> str | None:
        if not self.broker.reachable:
            return "the broker (Redis) is unreachable"
        if not self._live_engines():
            return f"no live engine serves model {self.model_name!r}"
        return None

    # ---- generation -------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._post(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._post(request, chat=False)

    async def _post(self, http: web.Request, chat: bool) -> web.StreamResponse:
        start = time.perf_counter()
        if (last := http.headers.get("Last-Event-ID")) is not None:
            # A client library re-sending its POST on reconnect: the rest of that stream, not a new run.
            request_id, seen = parse_event_id(last)
            return await self._resume(http, request_id, seen, start)
        body = await http.read()
        req = (parse_chat if chat else parse_completion)(parse_json(body), self.config)
        return await self._generate(http, req, body, start)

    async def _generate(self, http: web.Request, req: GenerationRequest, body: bytes,
                        start: float) -> web.StreamResponse:
        self._check_model(req.model)
        self._check_chars(req.messages if req.chat else None, req.tools, req.prompts)
        check_tool_parser(req.tools, self.config.tool_call_parser)
        await self._check_structured_output(http, req)
        async with AsyncExitStack() as admitted:
            runs = [await admitted.enter_async_context(self._admitted(http, one, one_body, start))
                    for one, one_body in _engine_requests(req, body)]
            return await serve_runs(runs)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")

    async def _check_structured_output(self, http: web.Request, req: GenerationRequest) -> None:
        """Compiles the schema / regex / grammar once (cached) on the tokenizer threads: a bad one is a 400
        here, never a failure in the engine."""
        if (so := req.params.structured_output) is None:
            return
        try:
            await self.off_loop(http, check_structured_output, so, self.config.max_structured_output_chars,
                                bounded=True)
        except ValueError as exc:
            raise APIError(400, str(exc), param=req.structured_output_param) from None

    @asynccontextmanager
    async def _admitted(self, http: web.Request, req: GenerationRequest, body: bytes,
                        start: float) -> AsyncIterator[_Run]:
        """One engine request from admission to its end: tokenized and checked, then queued with the key's
        slot held. Whatever happens once the slot is taken, leaving gives back all it took (the slot, the
        reply subscription, the engine's request and its KV blocks): ``_Run.close``, or ``_unadmit`` when
        the request never reached the queue."""
        prompt_ids, assembler = await self.off_loop(http, self._prepare, req, bounded=True)
        check_context(req, len(prompt_ids), self._context_len())
        self._check_capacity()
        request_id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        api_key, tenant = http.get(_API_KEY, ""), self.tenant_of(http)
        await self.limits.acquire(api_key, tenant, request_id, len(prompt_ids) + req.params.max_tokens * req.params.n)
        run: _Run | None = None
        try:
            msg, record = self._request_records(http, req, body, request_id, prompt_ids)
            queue = await self.broker.submit(msg, record)
            run = _Run(self, http, req, request_id, prompt_ids, assembler, queue, start, record.created)
            yield run
        except BrokerUnavailable as exc:
            raise unavailable(str(exc), self.config.retry_after_s) from exc
        finally:
            if run is None:
                self._unadmit(http, request_id)
            else:
                run.close()

    def _unadmit(self, http: web.Request, request_id: str) -> None:
        """A request that failed between taking its slot and being queued: the slot back, and an abort in
        case its queue entry landed all the same."""
        self.limits.release(http.get(_API_KEY, ""), self.tenant_of(http), request_id)
        self.abort_later(request_id)

    def _request_records(self, http: web.Request, req: GenerationRequest, body: bytes, request_id: str,
                         prompt_ids: list[int]) -> tuple[RequestMsg, StreamRecord]:
        """The engine's message and the stored record a resume reads."""
        api_key, tenant, now = http.get(_API_KEY, ""), self.tenant_of(http), time.time()
        msg = RequestMsg(request_id=request_id, prompt_token_ids=prompt_ids, params=params_to_wire(req.params),
                         gateway_id=self.gateway_id, arrival_time=now, model=self.model_name,
                         cache_salt=self._cache_salt(http, req.cache_salt),
                         priority=req.priority + self.limits.policy(api_key).priority, tenant=tenant)
        record = StreamRecord(request_id=request_id, gateway_id=self.gateway_id, body=body,
                              prompt_token_ids=prompt_ids, created=int(now), arrival_ms=int(now * 1000),
                              tenant=tenant)
        return msg, record

    # ---- /tokenize, /detokenize (vLLM's) -------------------------------------
    async def tokenize(self, http: web.Request) -> web.Response:
        req = parse_tokenize(parse_json(await http.read()))
        self._check_model(req.model)
        self._check_chars(req.messages, req.tools, [req.prompt])
        ids = await self.off_loop(http, self._tokenize_only, req, bounded=True)
        return web.json_response({"count": len(ids), "max_model_len": self._context_len(), "tokens": ids})

    def _tokenize_only(self, req: TokenizeRequest) -> list[int]:
        try:
            if req.messages is None:
                return self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            tools = req.tools.template_tools() if req.tools is not None else None
            return encode_chat(self.tokenizer, req.messages, req.add_generation_prompt, tools,
                               req.chat_template_kwargs)
        except (ValueError, TemplateError) as exc:
            raise APIError(400, str(exc), param="prompt" if req.messages is None else "messages") from exc

    async def detokenize(self, http: web.Request) -> web.Response:
        model, ids = parse_detokenize(parse_json(await http.read()))
        self._check_model(model)
        self._check_ids("tokens", ids)
        if len(ids) > (context := self._context_len()):
            raise APIError(400, f"This model's maximum context length is {context} tokens; this request has "
                                f"{len(ids)}.", param="tokens", code="context_length_exceeded")
        return web.json_response({"prompt": await self.off_loop(http, self.tokenizer.decode, ids, bounded=True)})

    # ---- resume (SSE Last-Event-ID) ----------------------------------------
    async def resume_stream(self, http: web.Request) -> web.StreamResponse:
        request_id = http.match_info["request_id"]
        seen = -1
        if (last := http.headers.get("Last-Event-ID")) is not None:
            last_id, seen = parse_event_id(last)
            if last_id != request_id:
                raise APIError(400, "Last-Event-ID names another request", code="invalid_last_event_id")
        return await self._resume(http, request_id, seen, time.perf_counter())

    async def _resume(self, http: web.Request, request_id: str, seen: int, start: float) -> web.StreamResponse:
        """Replays the stream through a fresh assembler (the same events make the same SSE events), sends
        those after ``seen``, then continues live. The broker checks the tenant before it touches anything:
        another key's stream is as unknown as one that never existed."""
        resumed = None
        if _REQUEST_ID.fullmatch(request_id):
            try:
                resumed = await self.broker.resume(request_id, self.tenant_of(http))
            except BrokerUnavailable as exc:
                raise unavailable(str(exc), self.config.retry_after_s) from exc
        if resumed is None:
            raise APIError(404, f"stream {request_id!r} is unknown or past the retention window",
                           code="stream_not_found")
        try:
            run = self._resumed_run(http, resumed, seen, start)
        except BaseException:
            self.broker.release(request_id)
            raise
        return await run.serve()

    def _resumed_run(self, http: web.Request, resumed: Resumed, seen: int, start: float) -> _Run:
        """The stored body parsed again: the same n, stop strings and formats make the same events."""
        record = resumed.record
        parse = parse_chat if record.request_id.startswith("chatcmpl-") else parse_completion
        req = parse(parse_json(record.body), self.config)
        req.stream = True
        return _Run(self, http, req, record.request_id, record.prompt_token_ids,
                    self._assembler(req, record.prompt_token_ids), resumed.queue, start, record.created,
                    skip_through=seen)

    def tenant_of(self, http: web.Request) -> str:
        """Whose stream it is: an HMAC of the API key, the same on every gateway (never the key itself)."""
        return hmac.new(_TENANT_KEY, http.get(_API_KEY, "").encode(), hashlib.sha256).hexdigest()

    async def off_loop(self, http: web.Request, fn: Callable[..., T], *args: Any, bounded: bool = False) -> T:
        """``fn(*args)`` on the tokenizer threads, in the turn of ``http``'s tenant; ``bounded`` (work that
        admits a new request): a 429 rather than a tenant queue longer than ``max_pending_requests``."""
        try:
            return await self._tokenizer_pool.run(self._share_of(http), fn, *args, bounded=bounded)
        except PoolFull as exc:
            raise APIError(429, f"{exc}; retry later", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None

    def _share_of(self, http: web.Request) -> str:
        """Whose turn a tokenizer job takes: the tenant's, or without keys (no tenants) the client address's."""
        return self.tenant_of(http) if self.config.all_keys else f"peer {http.remote}"

    def _check_chars(self, messages: list[dict[str, Any]] | None, tools: ToolRequest | None,
                     prompts: list[str | list[int]]) -> None:
        """Rejects a chat's ``messages`` (with ``tools``), or else any of ``prompts``, that cannot fit the
        context whatever the tokenizer makes of it, before paying for tokenizing it: even at
        ``max_chars_per_token`` characters per token it is too long. /tokenize is held to the same cap: the
        tokenizer's time is everyone's."""
        context = self._context_len()
        chars = context * self.config.max_chars_per_token
        if messages is not None:
            size = _chat_chars(messages, tools, self._chars_per_message)
            sizes = [(size, chars, "characters of messages, tools and their template")]
        else:  # each prompt is its own engine request and must fit on its own
            sizes = [(len(p), context, "token ids") if isinstance(p, list) else (len(p), chars, "characters")
                     for p in prompts]
        for size, limit, what in sizes:
            if size > limit:
                raise APIError(400, f"This model's maximum context length is {context} tokens, so this server "
                                    f"accepts at most {limit} {what}; this request has {size}.",
                               param="prompt" if messages is None else "messages", code="context_length_exceeded")

    def _prepare(self, req: GenerationRequest) -> tuple[list[int], OutputAssembler]:
        """The prompt's token ids and the detokenizers of its choices (which decode the prompt's tail)."""
        ids = self._tokenize(req)
        return ids, self._assembler(req, ids)

    def _assembler(self, req: GenerationRequest, prompt_ids: list[int]) -> OutputAssembler:
        return OutputAssembler(self.tokenizer, prompt_ids, req.params.n, req.stop, req.include_stop_str_in_output,
                               req.skip_special_tokens)

    def _tokenize(self, req: GenerationRequest) -> list[int]:
        try:
            if req.chat:
                tools = req.tools.template_tools() if req.tools is not None else None
                ids = encode_chat(self.tokenizer, req.messages, req.add_generation_prompt, tools,
                                  req.chat_template_kwargs)
            else:
                ids = req.prompt if isinstance(req.prompt, list) else encode_prompt(self.tokenizer, req.prompt)
        except (ValueError, TemplateError) as exc:  # no template, or the template refused the messages
            raise APIError(400, str(exc), param="messages" if req.chat else "prompt") from exc
        req.params.top_k = min(req.params.top_k, len(self.tokenizer))  # beyond the vocabulary, top-k keeps all
        for name, values in (("prompt", ids), ("stop_token_ids", req.params.stop_token_ids),
                             ("logit_bias", list(req.params.logit_bias or ()))):
            self._check_ids(name, values)
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt")
        return ids

    def _check_ids(self, name: str, ids: list[int]) -> None:
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{name} holds token ids outside the vocabulary [0, {vocab})", param=name)

    def _check_capacity(self) -> None:
        problem = self._unavailable_reason()
        if problem:
            raise unavailable(problem, self.config.retry_after_s)
        if self.broker.num_pending >= self.config.max_pending_requests:
            raise APIError(429, f"the request queue is full ({self.config.max_pending_requests} waiting); "
                                "retry later", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)})

    def abort_later(self, request_id: str) -> None:
        self.broker.abort_later(request_id)


# A choice's update with its logprobs in the endpoint's shape (None when not asked for or none came).
Update = tuple[ChoiceUpdate, dict[str, Any] | None]


class _Run:
    """One request in flight: turns reply events into an HTTP response. A resumed one (``skip_through``
    set) gets every event from the first and sends the SSE events after ``skip_through``."""

    def __init__(self, gateway: Gateway, http: web.Request, req: GenerationRequest, request_id: str,
                 prompt_ids: list[int], assembler: OutputAssembler, queue: asyncio.Queue[ReplyEvent],
                 start: float, created: int, skip_through: int | None = None) -> None:
        self.gw, self.http, self.req, self.request_id = gateway, http, req, request_id
        self.prompt_ids = prompt_ids
        self.queue = queue
        self.assembler = assembler
        self.logprobs = responses.LogprobFormatter(gateway.tokenizer, req.params.logprobs or 0)
        self.text_offsets = [0] * req.params.n  # per choice: where its next token's text starts (completions)
        self.created = created
        self.skip_through = skip_through
        self.start = start  # when the HTTP request arrived: TTFT includes validation and tokenizing
        self.last_token_time: float | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[Any] | None = None  # the engine's, from the first event that has them
        self.engine_done = False
        self.client_gone = False
        self.handed_over = False  # its subscription went to a newer connection (or was lost): not its to end
        self.closed = False
        # A streamed chat choice's parsers (reasoning, tool calls); a whole response parses each choice at its end.
        self.messages = [self._message_stream(i) for i in range(req.params.n)] if req.chat and req.stream else []

    async def serve(self) -> web.StreamResponse:
        return await serve_runs([self])

    async def guarded(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, None when the client went away; the run is closed either way."""
        try:
            return await work
        except ClientGone:
            self.client_gone = True
            return None
        except asyncio.CancelledError:  # aiohttp cancels a handler whose client hung up (or at shutdown)
            self.client_gone = True
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Every end publishes the abort, unless the engine already ended the request or another connection
        took the stream over; a stream whose client hung up is left running a while for the client to resume
        it (its key's slot is freed now). Once: the serving path and the admission both close it."""
        if self.closed:
            return
        self.closed = True
        self.gw.limits.release(self.http.get(_API_KEY, ""), self.gw.tenant_of(self.http), self.request_id)
        if self.handed_over:
            return
        if self.engine_done:
            self.gw.broker.release(self.request_id)
        elif self.client_gone and self.req.stream:
            self.gw.broker.detach(self.request_id)
        else:
            self.gw.abort_later(self.request_id)

    async def updates(self) -> AsyncIterator[list[Update]]:
        """Each hop takes every event waiting, so a busy stream pays one trip to the tokenizer threads
        for all its pending deltas, in order."""
        while not self.assembler.finished:
            events = await self._next_events()
            outputs = [e for e in events if e.kind is EventKind.OUTPUT]
            for event in outputs:
                self._observe(event)
            if outputs:
                updates = await self.gw.off_loop(self.http, self._apply, outputs)
                if any(e.finished for e in outputs):
                    self.engine_done = True
                elif self.assembler.finished:
                    self.gw.abort_later(self.request_id)  # a stop string ended it: free the engine's blocks now
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
            return unavailable(event.error or "no engine could serve this request", self.gw.config.retry_after_s)
        if self.handed_over:
            return APIError(event.status, event.error, code="stream_taken_over")
        return APIError(event.status, event.error or "the engine failed this request",
                        code="engine_error" if event.status >= 500 else None)

    async def _next_event(self) -> ReplyEvent:
        """Waits no longer than the client stays, nor than the broker keeps this run subscribed (a stream
        whose subscription went away ends with an error, never hangs)."""
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), self.gw.config.engine_poll_s)
            except asyncio.TimeoutError:
                transport = self.http.transport
                if transport is None or transport.is_closing():
                    raise ClientGone() from None
                if self.queue.empty() and not self.gw.broker.subscribed(self.request_id, self.queue):
                    return ReplyEvent(EventKind.ERROR, "", finished=True, status=HANDED_OVER_STATUS,
                                      error="this stream lost its subscription; resume it (Last-Event-ID)")

    def _observe(self, event: ReplyEvent) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = event.prompt_logprobs
        if self.skip_through is not None or not any(c.token_ids for c in event.choices):  # a replay: no latency
            return
        now = time.perf_counter()
        if self.last_token_time is None:
            self.gw.metrics.model_ttft.observe(now - self.start)
        else:
            self.gw.metrics.model_itl.observe(now - self.last_token_time)
        self.last_token_time = now

    def _record_finish(self) -> None:
        metrics, name = self.gw.metrics, self.gw.model_name
        metrics.e2e.labels(name).observe(time.perf_counter() - self.start)
        for index in range(self.req.params.n):
            metrics.success.labels(name, self.assembler.finish_reason(index)).inc()

    def _usage(self) -> dict[str, Any]:
        completion_tokens = 0 if self.req.echo_only else self.assembler.num_completion_tokens
        return responses.usage(len(self.prompt_ids), completion_tokens, self.num_cached_tokens)

    # ---- non-streaming ----------------------------------------------------
    async def complete(self) -> dict[str, Any]:
        """The whole response body."""
        lp_parts: list[list[dict[str, Any]]] = [[] for _ in range(self.req.params.n)]
        async for updates in self.updates():
            for u, logprobs in updates:
                if logprobs is not None:
                    lp_parts[u.index].append(logprobs)
        choices = [self._final_choice(i, parts) for i, parts in enumerate(lp_parts)]
        if self.req.echo or self.req.prompt_logprobs is not None:
            await self.gw.off_loop(self.http, self._add_prompt_parts, choices)
        obj = "chat.completion" if self.req.chat else "text_completion"
        return responses.envelope(self.request_id, obj, self.created, self.gw.model_name, choices, self._usage())

    def _add_prompt_parts(self, choices: list[dict[str, Any]]) -> None:
        """echo (the prompt's text, and with logprobs its tokens' logprobs, before each choice's) and vLLM's
        per-choice prompt_logprobs; on the tokenizer threads (a decode per prompt token)."""
        entries = self.prompt_logprobs or [None] * len(self.prompt_ids)
        if self.req.prompt_logprobs is not None:
            listed = self.logprobs.prompt_logprobs(entries, self.req.prompt_logprobs)
            for choice in choices:
                choice["prompt_logprobs"] = listed
        if self.req.echo:
            text = self.req.prompt if isinstance(self.req.prompt, str) else self.gw.tokenizer.decode(self.prompt_ids)
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
            yield self._chunk(roles)
        async for updates in self.updates():
            for u, logprobs in updates:
                if u.text or u.finish_reason or logprobs is not None:
                    for choice in self._chunk_choices(u, logprobs):
                        yield self._chunk([choice])

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.req.chat else "text_completion"
        return responses.envelope(self.request_id, obj, self.created, self.gw.model_name, choices, usage,
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
        tools, parser = self.req.tools, None
        if tools is not None and tools.forced:
            parser = ForcedCallParser(tools.name)
        elif tools is not None and tools.choice == "auto":
            parser = PARSERS[self.gw.config.tool_call_parser]()
        name = self.gw.config.reasoning_parser
        thinking = self.req.chat_template_kwargs.get("enable_thinking", True) is not False
        reasoning = ReasoningStream(name, thinking) if name else None
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


async def serve_runs(runs: list[_Run]) -> web.StreamResponse:
    """The response to one HTTP request: its one run, or one run per prompt of a list (choice i of prompt k
    is choice k * n + i, usage summed)."""
    if runs[0].req.stream:
        return await stream_runs(runs)
    tasks = [asyncio.ensure_future(run.guarded(run.complete())) for run in runs]
    try:
        bodies = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()  # an engine error in one prompt fails the response: the others stop too
        raise
    if any(body is None for body in bodies):
        return web.Response(status=499)  # nobody is listening; nginx's "client closed request"
    return web.json_response(responses.merge_prompts(bodies, runs[0].req.params.n))


async def stream_runs(runs: list[_Run]) -> web.StreamResponse:
    """One SSE stream: the runs' chunks one run after the other (the engine runs them all at once; the
    later ones' events wait in their queues), then the summed usage."""
    first = runs[0]
    # Validation is done and the requests are queued, so the 200 can go out now.
    sse = _SSEWriter(web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                 "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}),
                     first.request_id, -1 if first.skip_through is None else first.skip_through)
    try:
        await sse.response.prepare(first.http)
        for k, run in enumerate(runs):
            async for chunk in run.chunks():
                chunk["id"] = first.request_id
                for choice in chunk["choices"]:
                    choice["index"] += k * run.req.params.n
                await sse.send(chunk)
        if first.req.include_usage:
            await sse.send(first._chunk([], responses.sum_usage([run._usage() for run in runs])))
    except APIError as exc:
        await sse.send(exc.body())
    except (ClientGone, ConnectionResetError):
        for run in runs:
            run.client_gone = True
        return sse.response
    except asyncio.CancelledError:  # aiohttp cancels a handler whose client hung up (or at shutdown)
        for run in runs:
            run.client_gone = True
        raise
    except Exception:  # the 200 is out: the error can only be the stream's last event
        await sse.send(internal_error(f"stream of {first.request_id} failed", first.request_id).body())
    finally:
        for run in runs:
            run.close()
    await sse.done()
    return sse.response


class _SSEWriter:
    """``id: <request id>:<k>`` then ``data: <json>`` per event (k counts them from 0), ``data: [DONE]``
    last; the events up to ``skip_through`` (those a resuming client has) are counted, not sent."""

    def __init__(self, response: web.StreamResponse, request_id: str, skip_through: int) -> None:
        self.response = response
        self.request_id = request_id
        self.skip_through = skip_through
        self._next_id = 0

    async def send(self, body: dict[str, Any]) -> None:
        await self._write(json.dumps(body, separators=(",", ":"), ensure_ascii=False))

    async def done(self) -> None:
        await self._write("[DONE]")
        await self.response.write_eof()

    async def _write(self, data: str) -> None:
        k, self._next_id = self._next_id, self._next_id + 1
        if k > self.skip_through:
            await self.response.write(f"id: {self.request_id}:{k}\ndata: {data}\n\n".encode("utf-8"))


def _chat_chars(messages: list[dict[str, Any]], tools: ToolRequest | None, chars_per_message: int) -> int:
    """The characters a chat request renders: message text, tool-call arguments, tool definitions, and what
    the template adds around each message (so a flood of empty messages counts too)."""
    size = sum(len(m["content"]) + sum(len(json.dumps(c["function"]["arguments"])) for c in m.get("tool_calls", ()))
               for m in messages)
    listed = tools.template_tools() if tools is not None else None
    return size + len(messages) * chars_per_message + (len(json.dumps(listed)) if listed else 0)


def parse_event_id(value: str) -> tuple[str, int]:
    """``<request id>:<k>`` (an SSE event id of this server) as its parts; anything else (another shape of
    id, a number of more than 9 ASCII digits) is the client's mistake."""
    match = _EVENT_ID.fullmatch(value.strip())
    if match is None:
        raise APIError(400, "Last-Event-ID must be '<request id>:<event number>', as sent in the stream's "
                            "'id:' fields", code="invalid_last_event_id")
    return match[1], int(match[2])


def _engine_requests(req: GenerationRequest, body: bytes) -> list[tuple[GenerationRequest, bytes]]:
    """One engine request per prompt, each stored with its own prompt (so each resumes alone); a list of
    prompts is answered as one response whose choice k * n + i is choice i of prompt k."""
    if len(req.prompts) <= 1:
        return [(req, body)]
    fields = json.loads(body)
    return [(replace(req, prompt=prompt, prompts=[prompt], params=replace(req.params)),
             json.dumps({**fields, "prompt": prompt}).encode()) for prompt in req.prompts]


def unavailable(message: str, retry_after_s: int) -> APIError:
    """A 503 worth retrying soon (no engine, Redis unreachable, a deadline passed)."""
    return APIError(503, message, code="service_unavailable", headers={"Retry-After": str(retry_after_s)})


def internal_error(what: str, request_id: str | None = None, code: str = "internal_error",
                   with_traceback: bool = True) -> APIError:
    """A 500: logged with ``what`` (and the traceback being handled), while the client sees only an
    id to quote, never the exception's text."""
    request_id = request_id or f"err-{uuid.uuid4().hex}"
    log.error("%s (request id %s)", what, request_id, exc_info=with_traceback)
    return APIError(500, f"internal server error (request id {request_id})", code=code,
                    headers={"X-Request-Id": request_id})
