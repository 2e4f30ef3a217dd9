"""Schemathesis drives the gateway from its own /openapi.json, with valid and invalid
bodies: no 5xx ever, and every 4xx in OpenAI's error shape; and every body the request
schemas allow is taken (no 400, but for what no JSON schema can state: ``EXCUSED``). A real
HTTP gateway (behind the connection guard) on the in-memory broker with a fake engine behind
it, no Redis. The default run draws 120 cases per generation route (plus schemathesis'
coverage cases) and 150 schema-valid bodies per POST route, the slow run (-m slow) 1,000."""
from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import pytest
from aiohttp import web
from hypothesis import HealthCheck, Phase, given, settings
from transformers import AutoTokenizer

from engine.structured_output import check_structured_output
from service.config import GatewayConfig
from service.connections import GuardedAppRunner
from service.gateway import Gateway
from service.gateway_app import build_app
from service.local_stack import free_port
from service.memory_broker import MemoryBus, MemoryGatewayBroker
from service.openapi import openapi_document
from service.protocol import MAX_JSON_DEPTH, APIError, parse_chat, parse_completion
from tests.service.conftest import MODEL_NAME, memory_worker, running
from tests.service.fake_engine import FakeEngine

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402  (schemathesis is optional)

API_KEY = "sk-fuzz"
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck))
SCHEMA = schemathesis.openapi.from_dict(openapi_document(MODEL_NAME, GatewayConfig()))
CONTEXT = 64  # a short context keeps the fake engine's longest answer short


def serve(tokenizer, port: int, started: threading.Event, stop: asyncio.Event) -> None:
    async def main() -> None:
        bus = MemoryBus()
        config = GatewayConfig(engine_poll_s=0.05, api_keys=(API_KEY,))
        gateway = Gateway(config, tokenizer, MODEL_NAME, CONTEXT, MemoryGatewayBroker(bus, config))
        runner = GuardedAppRunner(build_app(gateway), config, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        # No fault hooks: a fuzzed prompt such as "1" starts with a hook's token, and the engine failures
        # it would inject (500, then the worker's exit after repeated failed steps) are not the API's.
        async with running(memory_worker(bus, FakeEngine(faults=False))):
            while not gateway.served.live_engines():  # the first case may be a valid request: serve it
                await asyncio.sleep(0.01)
            started.set()
            await stop.wait()
        await runner.cleanup()

    asyncio.run(main())


@pytest.fixture(scope="module")
def base_url(demo_model: str) -> Iterator[str]:
    port, started, stop = free_port(), threading.Event(), asyncio.Event()
    thread = threading.Thread(target=serve, args=(AutoTokenizer.from_pretrained(demo_model), port, started, stop),
                              daemon=True)
    thread.start()
    assert started.wait(30)
    yield f"http://127.0.0.1:{port}"
    stop._loop.call_soon_threadsafe(stop.set)  # the server's loop owns the event
    thread.join(10)


def check_call(case, base_url: str) -> None:
    response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert response.status_code < 500, (case.body, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        if case.path.startswith("/v1/messages"):  # Anthropic's shape
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, response.text
            return
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text


@SCHEMA.include(method="POST").parametrize()
@settings(FUZZ, max_examples=120)
def test_generation_routes_never_5xx(case, base_url: str) -> None:
    check_call(case, base_url)


@pytest.mark.slow
@SCHEMA.include(method="POST").parametrize()
@settings(FUZZ, max_examples=1000)
def test_generation_routes_never_5xx_long_run(case, base_url: str) -> None:
    check_call(case, base_url)


# ---- every body the schemas allow is taken --------------------------------------------------------
# The 400s no request schema can rule out, each for a reason JSON Schema cannot state. Bodies are drawn
# from the published schemas narrowed by what the server tells apart from them (the context length at
# /v1/models bounds max_tokens, max_completion_tokens and min_tokens; the tokenizer's vocabulary, token
# ids), so that most fall within those; the published schemas judge them.
POST_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize", "/detokenize"]
CONFIG = GatewayConfig()


def so_does_not_compile(body: dict[str, Any], error: dict[str, Any], path: str) -> bool:
    """The structured output (a JSON schema, regex, grammar, or a forced tool call's parameters) fails to
    compile: what compiles is xgrammar's to say."""
    if path not in ("/v1/chat/completions", "/v1/completions"):
        return False
    try:
        req = (parse_chat if path == "/v1/chat/completions" else parse_completion)(body, CONFIG)
    except APIError:  # refused before any compiling
        return False
    if req.params.structured_output is None or error["param"] != req.structured_output_param:
        return False
    try:
        check_structured_output(req.params.structured_output, CONFIG.max_structured_output_chars)
    except ValueError:
        return True
    return False


def min_tokens_beyond_max_tokens(body: dict[str, Any], error: dict[str, Any], path: str) -> bool:
    """min_tokens above max_tokens (a completion's default 16): a comparison of two fields, which JSON Schema
    lacks; or, a chat's max_tokens left out, above the room the context leaves after the prompt."""
    most = body.get("max_completion_tokens") or body.get("max_tokens") or (16 if path == "/v1/completions" else None)
    if error["param"] != "min_tokens":
        return False
    return "room left" in error["message"] if most is None else body.get("min_tokens", 0) > most


def n_above_best_of(body: dict[str, Any], error: dict[str, Any], path: str) -> bool:
    """Beam search's n above its beam width, best_of: again two fields compared."""
    return error["param"] == "n" and body.get("n", 1) > body.get("best_of", body.get("n", 1))


def in_message(*parts: str) -> Callable[[dict[str, Any], dict[str, Any], str], bool]:
    return lambda body, error, path: any(part in error["message"] for part in parts)


EXCUSED: dict[str, Callable[[dict[str, Any], dict[str, Any], str], bool]] = {
    # The prompt's length in tokens is the tokenizer's to say; the context's, the engines'.
    "context length": lambda body, error, path: error["code"] == "context_length_exceeded",
    # Token ids (prompt, stop_token_ids, logit_bias keys, tokens) must be below the vocabulary's size, which
    # is the checkpoint's; so is whether a text prompt tokenizes to anything at all.
    "vocabulary": in_message("outside the vocabulary", "empty after tokenization"),
    "structured output compiles": so_does_not_compile,
    "min_tokens": min_tokens_beyond_max_tokens,
    "best_of": n_above_best_of,
    # JSON text inside a string (contentMediaType is an annotation, not an assertion, in JSON Schema).
    "tool call arguments": in_message("function.arguments is not valid JSON", "function.arguments must be a JSON"),
    # uniqueItems compares whole items, and no schema names values of another field.
    "tool names": in_message("tool names must be unique", "which is not among the tools"),
    # Unknown fields are taken (and ignored), but the whole body nests at most MAX_JSON_DEPTH levels.
    "nesting": in_message(f"nested at most {MAX_JSON_DEPTH} levels"),
}


def request_schemas(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {path: document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            for path in POST_PATHS}


def bound_token_ids(schema: Any, vocab: int) -> None:
    """Every list of token ids (integers from 0) in ``schema`` within the vocabulary."""
    values = schema.values() if isinstance(schema, dict) else schema if isinstance(schema, list) else []
    if isinstance(schema, dict) and isinstance(items := schema.get("items"), dict) \
            and items.get("type") == "integer" and items.get("minimum") == 0:
        items["maximum"] = vocab - 1
    for value in values:
        bound_token_ids(value, vocab)


def narrowed(document: dict[str, Any], vocab: int) -> dict[str, Any]:
    document = copy.deepcopy(document)
    for schema in request_schemas(document).values():
        bound_token_ids(schema, vocab)
        for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if name in schema.get("properties", {}):
                schema["properties"][name]["maximum"] = CONTEXT
    return document


@pytest.fixture(scope="module")
def valid_schema(demo_model: str):
    vocab = len(AutoTokenizer.from_pretrained(demo_model))
    return schemathesis.openapi.from_dict(narrowed(openapi_document(MODEL_NAME, CONFIG), vocab))


VALIDATORS = {path: jsonschema.Draft202012Validator(schema)
              for path, schema in request_schemas(openapi_document(MODEL_NAME, CONFIG)).items()}


def check_taken(case, base_url: str, outcomes: Counter) -> None:
    if not VALIDATORS[case.path].is_valid(case.body):  # schemathesis' positive cases are valid: count if not
        outcomes["not schema-valid"] += 1
        return
    case.headers.pop("Last-Event-ID", None)  # a resume, whose 404 says nothing of the body
    response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert response.status_code < 500, (case.body, response.text[:500])
    if response.status_code != 400:
        outcomes[str(response.status_code)] += 1
        return
    error = response.json()["error"]
    reason = next((name for name, excused in EXCUSED.items() if excused(case.body, error, case.path)), None)
    assert reason is not None, f"a schema-valid body was refused: {error} for {json.dumps(case.body)[:2000]}"
    outcomes[f"400 excused: {reason}"] += 1


def run_valid_bodies(schema, path: str, base_url: str, examples: int) -> Counter:
    outcomes: Counter = Counter()

    @given(schema[path]["POST"].as_strategy(GenerationMode.POSITIVE))
    @settings(FUZZ, max_examples=examples, database=None)
    def run(case) -> None:
        check_taken(case, base_url, outcomes)

    run()
    return outcomes


@pytest.mark.parametrize("path", POST_PATHS)
def test_every_body_the_schema_allows_is_taken(path: str, base_url: str, valid_schema) -> None:
    outcomes = run_valid_bodies(valid_schema, path, base_url, 150)
    assert outcomes["200"] >= 10 and outcomes["not schema-valid"] <= outcomes.total() // 10, outcomes


@pytest.mark.slow
@pytest.mark.parametrize("path", POST_PATHS)
def test_every_body_the_schema_allows_is_taken_long_run(path: str, base_url: str, valid_schema) -> None:
    outcomes = run_valid_bodies(valid_schema, path, base_url, 1000)
    assert outcomes["200"] >= 50, outcomes


@pytest.mark.parametrize("tool_call_parser", ["hermes", "none"])
def test_schemathesis_generates_every_request_body(tool_call_parser: str) -> None:
    """The rules between fields stay within what schemathesis expands (it gives up past a few dozen branches)."""
    config = GatewayConfig(tool_call_parser=tool_call_parser)
    schema = schemathesis.openapi.from_dict(openapi_document(MODEL_NAME, config))
    for path in POST_PATHS:
        draw_one(schema[path]["POST"].as_strategy(GenerationMode.POSITIVE))


def draw_one(strategy) -> None:
    @given(strategy)
    @settings(FUZZ, max_examples=1, database=None, phases=[Phase.generate])
    def draw(_: Any) -> None:
        pass

    draw()
