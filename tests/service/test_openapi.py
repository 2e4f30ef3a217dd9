"""The API schema's sampling bounds are the ones the gateway enforces (SamplingParams' own,
and the server's caps on top); its rules between fields are the parser's; and the document
is the gateway's routes, each with the authentication the gateway asks for (the routes, by
requests to a real gateway app)."""
from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from engine.field_specs import value_bounds
from engine.sampling_params import SamplingParams
from service.config import GatewayConfig
from service.memory_broker import MemoryBus
from service.openapi import openapi_document
from service.protocol import APIError, parse_chat, parse_completion, parse_tokenize
from tests.service.conftest import MODEL_NAME, gateway_client

BOUNDED = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "max_tokens", "min_tokens", "logprobs"]
CONFIG = GatewayConfig()


def completion_properties() -> dict:
    post = openapi_document("m", CONFIG)["paths"]["/v1/completions"]["post"]
    return post["requestBody"]["content"]["application/json"]["schema"]["properties"]


def parse(name: str, value: float) -> SamplingParams:
    # min_tokens may not exceed max_tokens: open max_tokens up so min_tokens' own bounds are what is tested
    wide = {"max_tokens": value_bounds(SamplingParams, "max_tokens").high} if name == "min_tokens" else {}
    return parse_completion({"model": "m", "prompt": "x", name: value, **wide}, CONFIG).params


@pytest.mark.parametrize("name", BOUNDED)
def test_schema_bounds_are_enforced(name: str) -> None:
    schema = completion_properties()[name]
    step = 1 if schema["type"] == "integer" else 0.5
    if "minimum" in schema:
        parse(name, schema["minimum"])
        with pytest.raises(APIError, match=name) as below:
            parse(name, schema["minimum"] - step)
        assert below.value.status == 400 and below.value.param == name
    if "exclusiveMinimum" in schema:
        with pytest.raises(APIError, match=name):
            parse(name, schema["exclusiveMinimum"])
    if "maximum" in schema:
        parse(name, schema["maximum"])
        with pytest.raises(APIError, match=name) as above:
            parse(name, schema["maximum"] + step)
        assert above.value.status == 400 and above.value.param == name
    assert {"minimum", "exclusiveMinimum"} & set(schema)


def test_server_caps_and_model_are_in_the_document() -> None:
    props = completion_properties()
    assert props["model"] == {"enum": ["m"]} and props["n"]["maximum"] == CONFIG.max_n
    assert props["logprobs"]["maximum"] == CONFIG.max_logprobs
    assert props["stop"]["oneOf"][1]["maxItems"] == CONFIG.max_stop_strings


def test_defaults_are_the_engine_defaults() -> None:
    props, params = completion_properties(), SamplingParams()
    assert all(getattr(params, name) == schema["default"] for name, schema in props.items()
               if "default" in schema and name != "stream")


# ---- the rules between fields -------------------------------------------------
MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]
PARSERS = {"/v1/chat/completions": lambda body: parse_chat(body, CONFIG),
           "/v1/completions": lambda body: parse_completion(body, CONFIG), "/tokenize": parse_tokenize}
CROSS_FIELD = [  # (route, body): the schema and the parser agree on each, taken or refused
    ("/v1/completions", {"guided_json": {}, "guided_regex": "a", "guided_choice": ["a"], "guided_grammar": "a"}),
    ("/v1/completions", {"guided_regex": "a", "response_format": {"type": "text"}}),
    ("/v1/completions", {"guided_regex": "a"}),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "grammar": "b"}}),
    ("/v1/completions", {"structured_outputs": {"json_object": False}}),
    ("/v1/completions", {"structured_outputs": {"json_object": False, "regex": "a"}}),
    ("/v1/completions", {"response_format": {"type": "json_schema"}}),
    ("/v1/completions", {"use_beam_search": True, "n": 2, "best_of": 3}),
    ("/v1/completions", {"use_beam_search": True, "top_p": 0.5}),
    ("/v1/completions", {"use_beam_search": True, "stream": True}),
    ("/v1/completions", {"use_beam_search": True, "logprobs": 1}),
    ("/v1/completions", {"use_beam_search": True, "guided_regex": "a"}),
    ("/v1/completions", {"use_beam_search": True, "response_format": {"type": "text"}}),
    ("/v1/completions", {"best_of": 2, "n": 2, "use_beam_search": True}),
    ("/v1/completions", {"stream_options": {}}),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"stream": True, "echo": True}),
    ("/v1/completions", {"stream": True, "prompt_logprobs": 1}),
    ("/v1/completions", {"suffix": "a"}),
    ("/v1/completions", {"suffix": ""}),
    ("/v1/chat/completions", {"top_logprobs": 2}),
    ("/v1/chat/completions", {"top_logprobs": 2, "logprobs": True}),
    ("/v1/chat/completions", {"use_beam_search": True, "logprobs": True}),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "text"}}),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "use_beam_search": True}),
    ("/v1/chat/completions", {"tool_choice": "required"}),
    ("/v1/chat/completions", {"tool_choice": "none"}),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tools": []}}),
    ("/tokenize", {"prompt": "x", "messages": 5}),
    ("/tokenize", {"messages": MESSAGES, "tool_choice": "required"}),
    ("/tokenize", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}),
]


def request_schema(path: str) -> dict[str, Any]:
    return openapi_document(MODEL_NAME, CONFIG)["paths"][path]["post"]["requestBody"]["content"]["application/json"][
        "schema"]


def parser_takes(path: str, body: dict[str, Any]) -> bool:
    try:
        PARSERS[path](body)
    except APIError:
        return False
    return True


@pytest.mark.parametrize("path, extra", CROSS_FIELD)
def test_the_schema_refuses_what_the_parser_refuses(path: str, extra: dict[str, Any]) -> None:
    required = {"/v1/completions": {"model": MODEL_NAME, "prompt": "x"}, "/tokenize": {},
                "/v1/chat/completions": {"model": MODEL_NAME, "messages": MESSAGES}}[path]
    body = required | extra
    allowed = jsonschema.Draft202012Validator(request_schema(path)).is_valid(body)
    assert allowed == parser_takes(path, body)


# ---- routes and authentication --------------------------------------------------
KEYED = GatewayConfig(api_keys=("tenant-key",), admin_keys=("admin-key",))
STREAM_ID = "cmpl-" + "0" * 32


def operations(config: GatewayConfig) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, operation) for path, item in openapi_document(MODEL_NAME, config)["paths"].items()
            for method, operation in item.items()]


def url(path: str) -> str:
    return path.replace("{request_id}", STREAM_ID).replace("{model}", MODEL_NAME).replace("{response_id}", "resp_0")


async def test_the_document_lists_every_route_of_the_gateway(tokenizer) -> None:
    async with gateway_client(KEYED, tokenizer, MemoryBus()) as client:
        routes = {(r.method.lower(), r.resource.canonical) for r in client.server.app.router.routes()
                  if r.method != "HEAD"}
    assert routes == {(method, path) for path, method, _ in operations(KEYED)}


async def test_each_operation_asks_for_the_key_its_security_declares(tokenizer) -> None:
    async with gateway_client(KEYED, tokenizer, MemoryBus()) as client:
        for path, method, operation in operations(KEYED):
            response = await client.request(method.upper(), url(path))
            assert (response.status == 401) == (operation["security"] != []), (path, response.status)
            assert str(response.status) in operation["responses"], (path, response.status)
        response = await client.get("/metrics", headers={"Authorization": "Bearer tenant-key"})  # not an admin's
    metrics = openapi_document(MODEL_NAME, KEYED)["paths"]["/metrics"]["get"]
    assert response.status == 403 and "403" in metrics["responses"]


def test_without_keys_no_operation_declares_security() -> None:
    assert all(operation["security"] == [] and "401" not in operation["responses"]
               for _, _, operation in operations(GatewayConfig()))


async def test_a_method_not_allowed_names_the_allowed_ones(tokenizer) -> None:
    by_path: dict[str, set[str]] = {}
    for path, method, _ in operations(KEYED):
        by_path.setdefault(path, set()).add(method.upper())
    async with gateway_client(KEYED, tokenizer, MemoryBus()) as client:
        for path, methods in by_path.items():
            response = await client.put(url(path), headers={"Authorization": "Bearer admin-key"})
            allowed = methods | ({"HEAD"} if "GET" in methods else set())
            assert response.status == 405 and set(response.headers["Allow"].split(",")) == allowed, path
            error = (await response.json())["error"]
            assert error["type" if path.startswith("/v1/messages") else "code"] in ("invalid_request_error",
                                                                                 "method_not_allowed"), path


# ---- a vision-language model's document -----------------------------------------
IMAGE_ROUTES = {"/v1/chat/completions": "ImageURLPart", "/tokenize": "ImageURLPart",
                "/v1/responses": "InputImagePart", "/v1/messages": "AnthropicImageBlock",
                "/v1/messages/count_tokens": "AnthropicImageBlock"}


def titles(schema: Any) -> set[str]:
    """The titles of every subschema of ``schema``."""
    if isinstance(schema, list):
        return set().union(*map(titles, schema))
    if not isinstance(schema, dict):
        return set()
    own = {schema["title"]} if isinstance(schema.get("title"), str) else set()
    return own.union(*map(titles, schema.values()))


@pytest.mark.parametrize("takes_images", [False, True])
def test_the_document_is_openapi_and_names_the_image_parts_a_vision_model_takes(takes_images: bool) -> None:
    definitions = pytest.importorskip("schemathesis.specs.openapi.definitions")
    config = GatewayConfig(allowed_media_domains=("img.example.com",))
    document = openapi_document(MODEL_NAME, config, takes_images=takes_images)
    definitions.OPENAPI_31_VALIDATOR.validate(document)  # the OpenAPI 3.1 meta-schema
    for path, item in document["paths"].items():
        for operation in item.values():
            if "requestBody" in operation:
                schema = operation["requestBody"]["content"]["application/json"]["schema"]
                jsonschema.Draft202012Validator.check_schema(schema)
                named = titles(schema)
                assert named == ({IMAGE_ROUTES[path]} if takes_images and path in IMAGE_ROUTES else set()), path
            if path in IMAGE_ROUTES:
                too_large = operation["responses"]["413"]["description"]
                assert ("--max-image-bytes" in too_large) == takes_images, path
