"""The gateway's aiohttp application, built by ``build_app``: its routes, its middlewares (request tracking,
CORS, errors as OpenAI's error bodies, API keys) and its resources' lifetime (``cleanup_ctx``: the broker runs
while the app does; the tokenizer threads stop with it)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from service import anthropic_api, api_routes, dashboard
from service.broker_api import GatewayBroker
from service.connections import BodyTimeout, Handler, track_requests
from service.errors import APIError
from service.gateway import Gateway
from service.metrics import GatewayMetrics
from service.server_errors import internal_error
from service.status import Status
from service.tokenizer_threads import TokenizerThreads

Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
Lifetime = Callable[[web.Application], AsyncIterator[None]]


def build_app(gateway: Gateway) -> web.Application:
    config = gateway.config
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[track_requests, _cors(config.cors_origins), _errors(gateway.metrics),
                                       gateway.tenancy.authenticate])
    status = Status(config=config, served=gateway.served, broker=gateway.broker, metrics=gateway.metrics,
                    tenancy=gateway.tenancy, threads=gateway.threads, takes_images=gateway.images.spec is not None)
    _add_routes(app.router, gateway, status)
    # Started in this order, cleaned up in the reverse: the broker closes before the threads stop.
    app.cleanup_ctx.extend([_threads_lifetime(gateway.threads), _broker_lifetime(gateway.broker)])
    return app


def _add_routes(router: web.UrlDispatcher, gateway: Gateway, status: Status) -> None:
    router.add_post("/v1/chat/completions", gateway.chat_completions)
    router.add_post("/v1/completions", gateway.completions)
    router.add_post("/v1/embeddings", gateway.embeddings)
    translated = api_routes.TranslatedRoutes(gateway)
    router.add_post("/v1/messages", translated.messages)
    router.add_post("/v1/messages/count_tokens", translated.count_tokens)
    router.add_post("/v1/responses", translated.responses)
    router.add_get("/v1/responses/{response_id}", translated.get_response)
    router.add_delete("/v1/responses/{response_id}", translated.delete_response)
    router.add_post("/v1/responses/{response_id}/cancel", translated.cancel_response)
    router.add_get("/v1/streams/{request_id}", gateway.resumes.stream)
    router.add_post("/tokenize", gateway.tokenize)
    router.add_post("/detokenize", gateway.detokenize)
    router.add_get("/v1/models", status.models)
    router.add_get("/v1/models/{model}", status.model)
    router.add_get("/health", status.health)
    router.add_get("/ready", status.ready)
    router.add_get("/metrics", status.metrics)
    router.add_get("/openapi.json", status.openapi)
    router.add_get("/v1/kv_snapshot", status.kv_snapshot)
    for path in dashboard.PAGES:
        router.add_get(path, status.dashboard_page)


def _broker_lifetime(broker: GatewayBroker) -> Lifetime:
    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        await broker.start()
        yield
        await broker.close()
    return lifetime


def _threads_lifetime(threads: TokenizerThreads) -> Lifetime:
    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        yield
        threads.shutdown()
    return lifetime


def _errors(metrics: GatewayMetrics) -> Middleware:
    """Every error as its API's error body (OpenAI's; Anthropic's on the Messages routes; an unexpected one as a
    500 that names only a request id), counted."""
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        def answer(exc: APIError) -> web.Response:
            metrics.errors.labels(str(exc.status)).inc()
            body = anthropic_api.error_body(exc) if request.path in api_routes.ANTHROPIC_PATHS else exc.body()
            return web.json_response(body, status=exc.status, headers=exc.headers)

        try:
            return await handler(request)
        except APIError as exc:
            return answer(exc)
        except BodyTimeout as exc:  # the body trickled in too slowly: the connection closes after this
            return answer(APIError(408, str(exc), code="request_timeout", headers={"Connection": "close"}))
        except web.HTTPNotFound:  # no such route
            return answer(APIError(404, _unknown_route(request), code="not_found"))
        except web.HTTPException as exc:  # routing errors, 413 from aiohttp's body limit
            code = {405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None  # a 405's methods
            return answer(APIError(exc.status, exc.text or exc.reason, code=code, headers=allow))
        except Exception:
            return answer(internal_error(f"unhandled error on {request.path}"))
    return errors


def _unknown_route(request: web.Request) -> str:
    """A 404 that names the route asked for and the API routes served (the dashboard's pages left out)."""
    served = sorted({f"{r.method} {r.resource.canonical}" for r in request.app.router.routes()
                     if r.method != "HEAD" and r.resource.canonical.startswith("/v1/")})
    return f"Unknown route: {request.method} {request.path}. This server serves: {', '.join(served)}"


def _cors(origins: tuple[str, ...]) -> Middleware:
    @web.middleware
    async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        allowed = origin is not None and ("*" in origins or origin in origins)
        if request.method == "OPTIONS" and allowed:
            response: web.StreamResponse = web.Response(status=204)
        else:
            response = await handler(request)
        if allowed and not response.prepared:
            response.headers["Access-Control-Allow-Origin"] = origin
            # A browser client may resume a stream (Last-Event-ID, X-Resumable) and read its token (X-Request-Id).
            response.headers["Access-Control-Allow-Headers"] = ("Authorization, Content-Type, Last-Event-ID, X-Resumable, "
                                                                "x-api-key, anthropic-version")
            response.headers["Access-Control-Expose-Headers"] = "X-Request-Id"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Vary"] = "Origin"
        return response
    return cors
