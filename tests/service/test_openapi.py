"""The API schema's sampling bounds are the ones SamplingParams enforces."""
from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from service.openapi import openapi_document

BOUNDED = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "max_tokens", "min_tokens", "logprobs"]


def completion_properties() -> dict:
    post = openapi_document("m")["paths"]["/v1/completions"]["post"]
    return post["requestBody"]["content"]["application/json"]["schema"]["properties"]


def params(name: str, value: float) -> SamplingParams:
    # min_tokens may not exceed max_tokens: leave max_tokens open so min_tokens' own bounds are what is tested
    return SamplingParams(**{name: value}, **({"max_tokens": None} if name == "min_tokens" else {}))


@pytest.mark.parametrize("name", BOUNDED)
def test_schema_bounds_are_enforced(name: str) -> None:
    schema = completion_properties()[name]
    step = 1 if schema["type"] == "integer" else 0.5
    if "minimum" in schema:
        params(name, schema["minimum"])
        with pytest.raises(ValueError, match=name):
            params(name, schema["minimum"] - step)
    if "exclusiveMinimum" in schema:
        with pytest.raises(ValueError, match=name):
            params(name, schema["exclusiveMinimum"])
    if "maximum" in schema:
        params(name, schema["maximum"])
        with pytest.raises(ValueError, match=name):
            params(name, schema["maximum"] + step)
    assert {"minimum", "exclusiveMinimum"} & set(schema)


def test_defaults_are_the_engine_defaults() -> None:
    props, params = completion_properties(), SamplingParams()
    assert all(getattr(params, name) == schema["default"] for name, schema in props.items()
               if "default" in schema and name != "stream")
