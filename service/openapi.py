"""The OpenAPI 3.1 document served at /openapi.json (the routes and their
main fields; the full field semantics are OpenAI's, as read by vLLM). The
sampling fields' types, bounds and defaults come from SamplingParams."""
from __future__ import annotations

from dataclasses import MISSING, Field, fields
from typing import Any

from engine.field_specs import value_bounds, value_type
from engine.sampling_params import SamplingParams

from service.protocol import MAX_CACHE_SALT_CHARS

_JSON_TYPES = {int: "integer", float: "number", bool: "boolean"}
_PARAMS = {f.name: f for f in fields(SamplingParams)}


def _param(f: Field, with_default: bool = True) -> dict[str, Any]:
    """A SamplingParams field's schema: its type, bounds (of each item, for a list) and default."""
    kind = value_type(SamplingParams, f.name)
    value: dict[str, Any] = {"type": "integer" if kind is list else _JSON_TYPES[kind]}
    if (bounds := value_bounds(SamplingParams, f.name)) is not None:
        if bounds.low is not None:
            value["exclusiveMinimum" if bounds.low_open else "minimum"] = bounds.low
        if bounds.high is not None:
            value["maximum"] = bounds.high
    schema = {"type": "array", "items": value, "maxItems": f.metadata["max_items"]} if kind is list else value
    if with_default and f.default not in (None, MISSING):
        schema["default"] = f.default
    return schema


_MAX_TOKENS = _param(_PARAMS["max_tokens"], with_default=False)  # chat's default is "up to the context"
_SAMPLING = {
    **{name: _param(f) for name, f in _PARAMS.items() if name != "logprobs"}, "max_tokens": _MAX_TOKENS,
    "model": {"type": "string"}, "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "include_stop_str_in_output": {"type": "boolean"}, "skip_special_tokens": {"type": "boolean"},
    "user": {"type": "string"}, "cache_salt": {"type": "string", "maxLength": MAX_CACHE_SALT_CHARS},
}
_CHAT = {**_SAMPLING, "messages": {"type": "array", "items": {"type": "object", "required": ["role", "content"]}},
         "max_completion_tokens": _MAX_TOKENS, "logprobs": {"type": "boolean"},
         "top_logprobs": _param(_PARAMS["logprobs"])}
_COMPLETION = {**_SAMPLING, "prompt": {"oneOf": [{"type": "string"},
                                                 {"type": "array", "items": {"type": "integer"}}]},
               "logprobs": _param(_PARAMS["logprobs"])}
_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}
_ERROR_STATUSES = {"400": "invalid parameters or prompt too long", "401": "bad or missing API key",
                   "404": "unknown model", "413": "body too large", "429": "queue full (see Retry-After)",
                   "503": "Redis or every engine unavailable"}


def _generation_op(summary: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    errors = {code: {"description": text, "content": {"application/json": {"schema": _ERROR}}}
              for code, text in _ERROR_STATUSES.items()}
    ok = {"description": "a completion, or a text/event-stream of chunks ending with 'data: [DONE]'",
          "content": {"application/json": {}, "text/event-stream": {}}}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"type": "object", "required": required, "properties": properties}}}},
        "responses": {"200": ok, **errors}}}


def _get_op(summary: str, content_type: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK", "content": {content_type: {}}}}}}


def openapi_document(model_name: str) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "pagedserve", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving {model_name!r}"},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": _generation_op("Chat completion", _CHAT, ["model", "messages"]),
            "/v1/completions": _generation_op("Text completion", _COMPLETION, ["model", "prompt"]),
            "/v1/models": _get_op("The served model"),
            "/health": _get_op("Process alive (no API key needed)"),
            "/ready": _get_op("Redis reachable and an engine heartbeat fresh (503 otherwise)"),
            "/metrics": _get_op("Prometheus metrics", "text/plain"),
            "/openapi.json": _get_op("This document"),
        },
    }
