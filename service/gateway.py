"""The OpenAI-compatible gateway's generation endpoints (/v1/chat/completions, /v1/completions) and vLLM's
/tokenize and /detokenize: each request's rules checked once, here at the edge; the prompt tokenized off the
loop; the request admitted under its key's limits, submitted to the broker and answered by
``service.streaming``. The broker is given (Redis in deployments, ``service.memory_broker`` in unit tests);
``service.gateway_app`` builds the aiohttp application around a Gateway."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from engine.structured_output import check_structured_output

from service.assembler import OutputAssembler
from service.broker_api import GatewayBroker
from service.config import GatewayConfig
from service.errors import APIError, BrokerUnavailable
from service.limits import KeyLimits
from service.messages import RequestMsg, StreamRecord, params_to_wire
from service.metrics import GatewayMetrics
from service.prompts import Prompts
from service.protocol import (GenerationRequest, TokenizeRequest, check_context, parse_chat, parse_completion,
                              parse_detokenize, parse_json, parse_tokenize)
from service.resume import Resumes, new_request_id, parse_event_id
from service.served_model import ServedModel
from service.server_errors import unavailable
from service.streaming import Run, Serving, assembler_for, serve_runs
from service.tenancy import Tenancy
from service.tokenizer_threads import TokenizerThreads
from service.tools import check_tool_parser


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: PreTrainedTokenizerBase, model_name: str,
                 max_model_len: int, broker: GatewayBroker) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.broker = broker
        self.gateway_id = broker.gateway_id
        self.served = ServedModel(model_name, max_model_len, broker)
        self.metrics = GatewayMetrics(model_name, lambda: self.broker.engines)
        self.tenancy = Tenancy(config)
        self.threads = TokenizerThreads(config, tokenizer, self.tenancy)
        self.prompts = Prompts(tokenizer, config.max_chars_per_token)
        policies, default = config.policies()
        self.limits = KeyLimits(policies, default, config.retry_after_s,
                                lambda: broker.limiter(config.limit_lease_s))
        self.serving = Serving(config=config, tokenizer=tokenizer, model_name=model_name, broker=broker,
                               metrics=self.metrics, threads=self.threads)
        self.resumes = Resumes(self.serving, self.tenancy)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._post(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._post(request, chat=False)

    async def _post(self, http: web.Request, chat: bool) -> web.StreamResponse:
        start = time.perf_counter()
        if (last := http.headers.get("Last-Event-ID")) is not None:
            # A client library re-sending its POST on reconnect: the rest of that stream, not a new run.
            request_id, seen = parse_event_id(last)
            return await self.resumes.resume(http, request_id, seen, start)
        body = await http.read()
        req = (parse_chat if chat else parse_completion)(parse_json(body), self.config)
        return await self._generate(http, req, body, start)

    async def _generate(self, http: web.Request, req: GenerationRequest, body: bytes,
                        start: float) -> web.StreamResponse:
        await self.check(http, req)
        async with AsyncExitStack() as admitted:
            runs = [await admitted.enter_async_context(self.admitted(http, one, one_body, start))
                    for one, one_body in _engine_requests(req, body)]
            return await serve_runs(runs)

    async def check(self, http: web.Request, req: GenerationRequest) -> None:
        """The rules a parsed request meets before it is admitted (the context length comes with its tokens)."""
        self.served.check_name(req.model)
        self.prompts.check_size(req.messages if req.chat else None, req.tools, req.prompts, self.served.context_len())
        check_tool_parser(req.tools, self.config.tool_call_parser)
        await self._check_structured_output(http, req)

    async def _check_structured_output(self, http: web.Request, req: GenerationRequest) -> None:
        """Compiles the schema / regex / grammar once (cached) on the tokenizer threads: a bad one is a 400
        here, never a failure in the engine."""
        if (so := req.params.structured_output) is None:
            return
        try:
            await self.threads.run(http, check_structured_output, so, self.config.max_structured_output_chars,
                                   bounded=True)
        except ValueError as exc:
            raise APIError(400, str(exc), param=req.structured_output_param) from None

    @asynccontextmanager
    async def admitted(self, http: web.Request, req: GenerationRequest, body: bytes,
                        start: float) -> AsyncIterator[Run]:
        """One engine request from admission to its end: tokenized and checked, then queued with the key's
        slot held. The admission owns what it took: leaving gives the slot back and ends the run (the reply
        subscription, the engine's request and its KV blocks), or, when the request never reached the queue,
        aborts it in case its queue entry landed all the same."""
        prompt_ids, assembler = await self.threads.run(http, self._prepare, req, bounded=True)
        check_context(req, len(prompt_ids), self.served.context_len())
        self._check_capacity()
        request_id = new_request_id(req.chat)
        api_key, tenant = self.tenancy.api_key(http), self.tenancy.tenant_of(http)
        await self.limits.acquire(api_key, tenant, request_id, len(prompt_ids) + req.params.max_tokens * req.params.n)
        run: Run | None = None
        try:
            msg, record = self._request_records(http, req, body, request_id, prompt_ids)
            queue = await self.broker.submit(msg, record)
            run = Run(serving=self.serving, http=http, req=req, request_id=request_id, prompt_ids=prompt_ids,
                      assembler=assembler, queue=queue, start=start, created=record.created)
            yield run
        except BrokerUnavailable as exc:
            raise unavailable(str(exc), self.config.retry_after_s) from exc
        finally:
            self.limits.release(api_key, tenant, request_id)
            if run is None:
                self.broker.abort_later(request_id)
            else:
                run.end()

    def _prepare(self, req: GenerationRequest) -> tuple[list[int], OutputAssembler]:
        """The prompt's token ids and the detokenizers of its choices (which decode the prompt's tail)."""
        ids = self.prompts.encode(req)
        return ids, assembler_for(self.tokenizer, req, ids)

    def _check_capacity(self) -> None:
        if problem := self.served.unavailable_reason():
            raise unavailable(problem, self.config.retry_after_s)
        if self.broker.num_pending >= self.config.max_pending_requests:
            raise APIError(429, f"the request queue is full ({self.config.max_pending_requests} waiting); "
                                "retry later", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)})

    def _request_records(self, http: web.Request, req: GenerationRequest, body: bytes, request_id: str,
                         prompt_ids: list[int]) -> tuple[RequestMsg, StreamRecord]:
        """The engine's message and the stored record a resume reads."""
        api_key, tenant, now = self.tenancy.api_key(http), self.tenancy.tenant_of(http), time.time()
        msg = RequestMsg(request_id=request_id, prompt_token_ids=prompt_ids, params=params_to_wire(req.params),
                         gateway_id=self.gateway_id, arrival_time=now, model=self.served.name,
                         cache_salt=self.tenancy.cache_salt(http, req.cache_salt),
                         priority=req.priority + self.limits.policy(api_key).priority, tenant=tenant)
        record = StreamRecord(request_id=request_id, gateway_id=self.gateway_id, body=body,
                              prompt_token_ids=prompt_ids, created=int(now), arrival_ms=int(now * 1000),
                              tenant=tenant)
        return msg, record

    # ---- /tokenize, /detokenize (vLLM's) -------------------------------------
    async def tokenize(self, http: web.Request) -> web.Response:
        ids = await self.token_ids(http, parse_tokenize(parse_json(await http.read())))
        return web.json_response({"count": len(ids), "max_model_len": self.served.context_len(), "tokens": ids})

    async def token_ids(self, http: web.Request, req: TokenizeRequest) -> list[int]:
        """A prompt's or a conversation's token ids, through the chat template as a generation would have them."""
        self.served.check_name(req.model)
        self.prompts.check_size(req.messages, req.tools, [req.prompt], self.served.context_len())
        return await self.threads.run(http, self.prompts.encode_tokenize, req, bounded=True)

    async def detokenize(self, http: web.Request) -> web.Response:
        model, ids = parse_detokenize(parse_json(await http.read()))
        self.served.check_name(model)
        self.prompts.check_ids("tokens", ids)
        self.prompts.check_size(None, None, [ids], self.served.context_len(), param="tokens")
        return web.json_response({"prompt": await self.threads.run(http, self.tokenizer.decode, ids, bounded=True)})


def _engine_requests(req: GenerationRequest, body: bytes) -> list[tuple[GenerationRequest, bytes]]:
    """One engine request per prompt, each stored with its own prompt (so each resumes alone); a list of
    prompts is answered as one response whose choice k * n + i is choice i of prompt k."""
    if len(req.prompts) <= 1:
        return [(req, body)]
    fields = json.loads(body)
    return [(replace(req, prompt=prompt, prompts=[prompt], params=replace(req.params)),
             json.dumps({**fields, "prompt": prompt}).encode()) for prompt in req.prompts]
