"""The API schema's sampling bounds are the ones the gateway enforces (SamplingParams' own,
and the server's caps on top)."""
from __future__ import annotations

import pytest

from engine.field_specs import value_bounds
from engine.sampling_params import SamplingParams
from service.config import GatewayConfig
from service.openapi import openapi_document
from service.protocol import APIError, parse_completion

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
