"""tools / tool_choice validation, and the forced-call schemas checked with jsonschema against outputs."""
from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from service.protocol import APIError
from service.tools import MAX_TOOLS, check_tool_parser, parse_tool_request

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _tool(name: str, parameters: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    fn = {"name": name, **extra} | ({"parameters": parameters} if parameters is not None else {})
    return {"type": "function", "function": fn}


TOOLS = [_tool("get_weather", WEATHER, description="weather now"), _tool("get-time")]


def _error(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        parse_tool_request(body)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("body, param", [
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [_tool("has space")]}, "tools[0]"),
    ({"tools": [_tool("x" * 65)]}, "tools[0]"),
    ({"tools": [_tool("ok", parameters="{}")]}, "tools[0]"),  # type: ignore[arg-type]
    ({"tools": [_tool("ok", description=3)]}, "tools[0]"),
    ({"tools": [_tool("ok", strict="yes")]}, "tools[0]"),
    ({"tools": [_tool("a"), _tool("a")]}, "tools"),
    ({"tools": [_tool(f"t{i}") for i in range(MAX_TOOLS + 1)]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),  # a forced call needs a tool to call
    ({"tool_choice": {"type": "function", "function": {"name": "get-time"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_rejected(body: dict[str, Any], param: str) -> None:
    assert _error(body).param == param


def test_no_tools() -> None:
    assert parse_tool_request({}) is None
    assert parse_tool_request({"tools": []}) is None
    assert parse_tool_request({"tool_choice": "auto"}) is None  # nothing to choose from: no change
    assert parse_tool_request({"tools": [], "tool_choice": "none"}) is None


def test_defaults_and_template_tools() -> None:
    req = parse_tool_request({"tools": TOOLS})
    assert (req.choice, req.name, req.parallel, req.forced) == ("auto", None, True, False)
    assert req.schema() is None
    assert req.template_tools() == TOOLS  # as sent: the template renders the client's own dicts
    forced = parse_tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get-time"}}})
    assert forced.schema() == {"type": "object", "properties": {}}  # no parameters: any object
    assert parse_tool_request({"tools": TOOLS, "tool_choice": "none"}).template_tools() is None


def test_named_function_schema() -> None:
    req = parse_tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert req.forced and req.name == "get_weather"
    jsonschema.validate({"city": "Oslo"}, req.schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"town": "Oslo"}, req.schema())


@pytest.mark.parametrize("parallel", [True, False])
def test_required_schema(parallel: bool) -> None:
    schema = parse_tool_request({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel}).schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    one = [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    two = one + [{"name": "get-time", "parameters": {}}]
    jsonschema.validate(one, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
                [{"name": "get-time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)


def test_structured_output() -> None:
    pytest.importorskip("engine.structured_output")
    req = parse_tool_request({"tools": TOOLS, "tool_choice": "required"})
    assert json.loads(req.structured_output().json) == req.schema()
    assert parse_tool_request({"tools": TOOLS}).structured_output() is None


def test_auto_needs_a_parser() -> None:
    auto = parse_tool_request({"tools": TOOLS})
    for parser in (None, "none"):
        with pytest.raises(APIError) as info:
            check_tool_parser(auto, parser)
        assert info.value.param == "tool_choice" and "--tool-call-parser" in info.value.message
    check_tool_parser(auto, "hermes")
    check_tool_parser(parse_tool_request({"tools": TOOLS, "tool_choice": "required"}), None)
    check_tool_parser(None, None)
