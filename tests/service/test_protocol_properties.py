"""Property tests of the request parsers, no server: whatever the body, parsing ends in a
``GenerationRequest`` that respects every bound, or in an ``APIError`` (a 4xx), never in
another exception."""
from __future__ import annotations

import json
import math
from dataclasses import fields

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.field_specs import value_bounds
from engine.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from service.config import GatewayConfig
from service.protocol import (MAX_CACHE_SALT_CHARS, MAX_JSON_DEPTH, APIError, GenerationRequest, check_context,
                              parse_chat, parse_completion, parse_json)

CONFIG = GatewayConfig()
FIELDS = [f.name for f in fields(SamplingParams)] + [
    "model", "stream", "stream_options", "stop", "include_stop_str_in_output", "skip_special_tokens", "user",
    "best_of", "use_beam_search", "logit_bias", "cache_salt", "messages", "max_completion_tokens", "top_logprobs",
    "add_generation_prompt", "tools", "tool_choice", "functions", "response_format", "prompt", "echo", "suffix",
    "role", "content", "type", "text", "include_usage", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "structured_outputs", "json_schema", "schema", "json", "regex", "choice", "grammar",
    "json_object", "prompt_logprobs", "chat_template_kwargs", "tool_calls", "tool_call_id", "name", "function",
    "arguments", "parallel_tool_calls"]
NUMBERS = st.one_of(st.integers(), st.floats(allow_nan=True), st.sampled_from(
    [0, 1, -1, 2, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**400, -10**400, 0.5, 2.0, 1e308, -0.0]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=20), st.sampled_from(["user", "text", "m"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), inner, max_size=5)),
    max_leaves=20)
PARTS = st.lists(st.fixed_dictionaries({}, optional={"type": st.sampled_from(["text", "image_url"]) | VALUES,
                                                     "text": st.text(max_size=10) | VALUES}), max_size=3)
MESSAGES = st.lists(st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "assistant", "system", "wizard"]) | VALUES,
    "content": st.text(max_size=10) | PARTS | VALUES, "tool_calls": VALUES, "tool_call_id": st.text(max_size=5) | VALUES}),
    max_size=3) | VALUES
# Mostly well-formed envelopes (so parsing gets past the first checks), with any value in any field.
BODIES = st.fixed_dictionaries({"model": st.just("m") | VALUES, "messages": MESSAGES,
                                "prompt": st.text(min_size=1, max_size=10) | st.lists(NUMBERS, max_size=3) | VALUES},
                               optional={name: VALUES for name in FIELDS if name not in ("model", "messages",
                                                                                        "prompt")}) | VALUES
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_within_bounds(request: GenerationRequest) -> None:
    params = request.params
    for f in fields(SamplingParams):
        value = getattr(params, f.name)
        bounds = value_bounds(SamplingParams, f.name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float):
                assert math.isfinite(item)
            if bounds is not None and item is not None:
                assert item in bounds, (f.name, item)
    assert params.n <= CONFIG.max_n and len(params.stop_token_ids) <= MAX_STOP_TOKEN_IDS
    assert len(request.stop) <= CONFIG.max_stop_strings
    assert all(0 < len(s) <= CONFIG.max_stop_string_len for s in request.stop)
    assert request.cache_salt is None or len(request.cache_salt) <= MAX_CACHE_SALT_CHARS


def parse_or_4xx(parse, body) -> GenerationRequest | None:
    try:
        request = parse(body, CONFIG)
    except APIError as exc:
        assert 400 <= exc.status < 500 and exc.body()["error"]["message"]
        return None
    assert_within_bounds(request)
    return request


@PROPERTY
@given(BODIES)
def test_chat_parser_never_fails_otherwise(body) -> None:
    request = parse_or_4xx(parse_chat, body)
    if request is not None:
        assert request.chat and request.messages and all(isinstance(m["content"], str) for m in request.messages)


@PROPERTY
@given(BODIES, st.integers(min_value=1, max_value=5000), st.integers(min_value=2, max_value=4096))
def test_completion_parser_and_context_check_never_fail_otherwise(body, num_prompt_tokens, max_model_len) -> None:
    request = parse_or_4xx(parse_completion, body)
    if request is None:
        return
    try:
        check_context(request, num_prompt_tokens, max_model_len)
    except APIError as exc:
        assert exc.status == 400
        return
    assert num_prompt_tokens + request.params.max_tokens <= max_model_len


@PROPERTY
@given(st.binary(max_size=200) | st.builds(lambda v: json.dumps(v).encode(), VALUES))
def test_json_parser_never_fails_otherwise(raw: bytes) -> None:
    try:
        parse_json(raw)
    except APIError as exc:
        assert exc.status == 400


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=MAX_JSON_DEPTH + 1, max_value=200_000), st.sampled_from("[{"))
def test_json_nested_too_deep_is_400(depth: int, opener: str) -> None:
    raw = ('{"a":' * depth + "1" + "}" * depth) if opener == "{" else "[" * depth + "]" * depth
    try:
        parse_json(raw.encode())
    except APIError as exc:
        assert exc.status == 400 and "nested" in exc.message
    else:
        raise AssertionError("accepted")
