"""The OpenAI-compatible gateway's generation endpoints (/v1/chat/completions, /v1/completions), its embeddings
(/v1/embeddings: one prefill-only engine request per input) and vLLM's /tokenize and /detokenize: each request's
rules checked once, here at the edge; the prompt tokenized off the loop; the request admitted under its key's
limits, submitted to the broker and answered by ``service.streaming``. The broker is given (Redis in deployments,
``service.memory_broker`` in unit tests); ``service.gateway_app`` builds the aiohttp application around a Gateway."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from engine.pooler_config import PoolerConfig
from engine.structured_output import check_structured_output

from service import responses
from service.assembler import OutputAssembler
from service.broker_api import GatewayBroker
from service.config import GatewayConfig
from service.errors import APIError, BrokerUnavailable
from service.limits import KeyLimits
from service.images import GatewayImages
from service.messages import RequestMsg, StreamRecord, images_to_wire, params_to_wire, pooling_to_wire
from service.metrics import GatewayMetrics
from service.prompts import Prompts
from service.protocol import (GenerationRequest, TokenizeRequest, check_context, check_input, parse_chat,
                              parse_completion, parse_detokenize, parse_embeddings, parse_json, parse_tokenize)
from service.resume import Resumes, new_request_id, parse_event_id
from service.served_model import ServedModel
from service.server_errors import unavailable
from service.streaming import Run, Serving, assembler_for, gather_runs, serve_runs
from service.tenancy import Tenancy
from service.tokenizer_threads import TokenizerThreads
from service.tools import check_tool_parser


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: PreTrainedTokenizerBase, model_name: str,
                 max_model_len: int, broker: GatewayBroker, pooler: PoolerConfig | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.broker = broker
        self.gateway_id = broker.gateway_id
        self.served = ServedModel(model_name, max_model_len, broker, pooler)
        self.metrics = GatewayMetrics(model_name, lambda: self.broker.engines)
        self.tenancy = Tenancy(config)
        self.threads = TokenizerThreads(config, tokenizer, self.tenancy)
        self.prompts = Prompts(tokenizer, config.max_chars_per_token)
        self.images = GatewayImages(config, config.model, tokenizer)  # a vision-language checkpoint's image reader
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
        await self.images.read(req.messages)
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
        """One engine request from admission to its end: tokenized and checked, then queued (``queued``)."""
        prompt_ids, assembler = await self.threads.run(http, self._prepare, req, bounded=True)
        check_context(req, len(prompt_ids), self.served.context_len())
        async with self.queued(http, req, body, prompt_ids, assembler, start) as run:
            yield run

    @asynccontextmanager
    async def queued(self, http: web.Request, req: GenerationRequest, body: bytes, prompt_ids: list[int],
                     assembler: OutputAssembler, start: float, batch_admitted: bool = False) -> AsyncIterator[Run]:
        """A checked request queued with the key's slot held. The admission owns what it took: leaving gives
        the slot back and ends the run (the reply subscription, the engine's request and its KV blocks), or,
        when the request never reached the queue, aborts it in case its queue entry landed all the same.
        ``batch_admitted``: the queue had room when its embeddings batch arrived (checked once for the batch)."""
        if not batch_admitted:
            self._check_capacity()
        request_id = new_request_id(req)
        api_key, tenant = self.tenancy.api_key(http), self.tenancy.tenant_of(http)
        await self.limits.acquire(api_key, tenant, request_id, req.budget(len(prompt_ids)))
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
        if req.chat:  # images: decoded and preprocessed here, once; their placeholders expanded
            ids, req.images = self.images.place(req.messages, ids)
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
        pooling = None if req.pooling is None else pooling_to_wire(req.pooling)
        msg = RequestMsg(request_id=request_id, prompt_token_ids=prompt_ids,
                         params=params_to_wire(req.params) if pooling is None else {}, pooling=pooling,
                         gateway_id=self.gateway_id, arrival_time=now, model=self.served.name,
                         cache_salt=self.tenancy.cache_salt(http, req.cache_salt),
                         priority=req.priority + self.limits.policy(api_key).priority, tenant=tenant,
                         images=images_to_wire(req.images))
        record = StreamRecord(request_id=request_id, gateway_id=self.gateway_id, body=body,
                              prompt_token_ids=prompt_ids, created=int(now), arrival_ms=int(now * 1000),
                              tenant=tenant)
        return msg, record

    # ---- /v1/embeddings (OpenAI's) ---------------------------------------------
    async def embeddings(self, http: web.Request) -> web.Response:
        """One engine request per input, all checked before any is queued; the vectors in input order."""
        start, body = time.perf_counter(), await http.read()
        req = parse_embeddings(parse_json(body))
        self.served.check_name(req.model)
        self.served.check_pooling(req.pooling)
        ids = await self._input_ids(http, req.prompts)
        req = replace(req, prompts=ids, prompt=ids[0])
        # One admission for the batch, as OpenAI's 2,048 inputs (LangChain sends 1,000) may outnumber
        # --max-pending-requests: their prefills then queue behind it.
        self._check_capacity()
        async with AsyncExitStack() as admitted:
            # An empty assembler: nothing is decoded, the final event ends the run's one choice.
            runs = [await admitted.enter_async_context(self.queued(http, one, one_body, one.prompt,
                                                                   assembler_for(self.tokenizer, one, []), start,
                                                                   batch_admitted=True))
                    for one, one_body in _engine_requests(req, body, "input")]
            vectors = await gather_runs(runs, Run.pooled)
        if vectors is None:
            return web.Response(status=499)  # nobody is listening
        return web.json_response(responses.embeddings(vectors, req.encoding_format, self.served.name,
                                                      sum(map(len, ids))))

    async def _input_ids(self, http: web.Request, inputs: list[str | list[int]]) -> list[list[int]]:
        """Each input's token ids, held to the vocabulary and the context; a 400 names the input (its index in
        a list). Every size is capped before any input is tokenized."""
        context = self.served.context_len()
        params = [f"input[{i}]" for i in range(len(inputs))] if len(inputs) > 1 else ["input"]
        for one, param in zip(inputs, params):
            self.prompts.check_size(None, None, [one], context, param=param)

        def tokenized() -> list[list[int]]:
            ids = [self.prompts.prompt_ids(one, param) for one, param in zip(inputs, params)]
            for one, param in zip(ids, params):
                check_input(len(one), context, param)
            return ids
        return await self.threads.run(http, tokenized, bounded=True)

    # ---- /tokenize, /detokenize (vLLM's) -------------------------------------
    async def tokenize(self, http: web.Request) -> web.Response:
        ids = await self.token_ids(http, parse_tokenize(parse_json(await http.read())))
        return web.json_response({"count": len(ids), "max_model_len": self.served.context_len(), "tokens": ids})

    async def token_ids(self, http: web.Request, req: TokenizeRequest) -> list[int]:
        """A prompt's or a conversation's token ids, through the chat template as a generation would have them:
        each image's placeholder expanded to its image tokens, so the count is the chat's ``prompt_tokens``."""
        self.served.check_name(req.model)
        self.prompts.check_size(req.messages, req.tools, [req.prompt], self.served.context_len())
        if req.messages is not None:
            await self.images.read(req.messages)
        return await self.threads.run(http, self._tokenized, req, bounded=True)

    def _tokenized(self, req: TokenizeRequest) -> list[int]:
        ids = self.prompts.encode_tokenize(req)
        return ids if req.messages is None else self.images.place(req.messages, ids)[0]

    async def detokenize(self, http: web.Request) -> web.Response:
        model, ids = parse_detokenize(parse_json(await http.read()))
        self.served.check_name(model)
        self.prompts.check_ids("tokens", ids)
        self.prompts.check_size(None, None, [ids], self.served.context_len(), param="tokens")
        return web.json_response({"prompt": await self.threads.run(http, self.tokenizer.decode, ids, bounded=True)})


def _engine_requests(req: GenerationRequest, body: bytes,
                     field: str = "prompt") -> list[tuple[GenerationRequest, bytes]]:
    """One engine request per prompt, each stored with its own prompt in ``field`` (so each resumes alone); a
    list of prompts is answered as one response whose choice k * n + i is choice i of prompt k."""
    if len(req.prompts) <= 1:
        return [(req, body)]
    fields = json.loads(body)
    return [(replace(req, prompt=prompt, prompts=[prompt], params=replace(req.params)),
             json.dumps({**fields, field: prompt}).encode()) for prompt in req.prompts]
