"""What the gateway says about itself: liveness, readiness, the model card, the metrics, the OpenAPI document,
the dashboard's pages and the KV snapshots they draw."""
from __future__ import annotations

import time

from aiohttp import web

from service import dashboard
from service.broker_api import GatewayBroker
from service.config import GatewayConfig
from service.errors import APIError, BrokerUnavailable
from service.metrics import CONTENT_TYPE, GatewayMetrics
from service.openapi import openapi_document
from service.served_model import ServedModel
from service.server_errors import unavailable
from service.tenancy import Tenancy
from service.tokenizer_threads import TokenizerThreads


class Status:
    def __init__(self, *, config: GatewayConfig, served: ServedModel, broker: GatewayBroker,
                 metrics: GatewayMetrics, tenancy: Tenancy, threads: TokenizerThreads, takes_images: bool) -> None:
        self._config = config
        self._takes_images = takes_images  # a vision-language model's document describes its image parts
        self._served = served
        self._broker = broker
        self._metrics = metrics
        self._tenancy = tenancy
        self._threads = threads
        self._created = int(time.time())  # the model card's

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _: web.Request) -> web.Response:
        if problem := self._served.unavailable_reason():
            return web.json_response({"status": "unavailable", "reason": problem}, status=503)
        return web.json_response({"status": "ready", "engines": len(self._served.live_engines())})

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, http: web.Request) -> web.Response:
        """GET /v1/models/{model}: the card of the served model (the SDK's ``models.retrieve``), else a 404."""
        self._served.check_name(http.match_info["model"])
        return web.json_response(self._card())

    def _card(self) -> dict:
        name = self._served.name
        return {"id": name, "object": "model", "created": self._created, "owned_by": "pagedserve", "root": name,
                "max_model_len": self._served.context_len()}

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi(self, _: web.Request) -> web.Response:
        return web.json_response(openapi_document(self._served.name, self._config, self._served.pooler,
                                                  self._takes_images))

    async def dashboard_page(self, http: web.Request) -> web.Response:
        body, content_type = dashboard.page(http.path)
        return web.Response(body=body, content_type=content_type, headers=dashboard.PAGE_HEADERS)

    async def kv_snapshot(self, http: web.Request) -> web.Response:
        """An engine's latest KV snapshot (the first live one's unless ``?engine=``); asking is what makes
        the engine publish them, so the first answer may hold none yet (``snapshot``: null)."""
        engines, name = sorted(self._served.live_engines()), self._served.name
        if not engines:
            raise unavailable(f"no live engine serves model {name!r}", self._config.retry_after_s)
        engine_id = http.query.get("engine") or engines[0]
        if engine_id not in engines:
            raise APIError(404, f"no live engine {engine_id!r} serves model {name!r}", param="engine",
                           code="engine_not_found")
        try:
            payload = await self._broker.kv_snapshot(engine_id)
        except BrokerUnavailable as exc:
            raise unavailable(str(exc), self._config.retry_after_s) from exc
        viewer = None if self._tenancy.is_admin(http) else self._tenancy.tenant_of(http)
        snapshot = await self._threads.run(http, dashboard.snapshot_json, payload, time.time(), viewer)
        response = web.json_response({"object": "kv_snapshot", "engines": engines, "engine": engine_id,
                                      "snapshot": snapshot})
        response.enable_compression()
        return response
