"""The OpenAPI 3.1 document served at /openapi.json (the routes and their
main fields; the full field semantics are OpenAI's, as read by vLLM). The
sampling fields' types, bounds and defaults come from SamplingParams, the
server's own caps (n and best_of, logprobs, stop strings) and the model name from the
gateway's config, so a fuzzer driven by the document sends what the server takes."""
from __future__ import annotations

from dataclasses import MISSING, Field, fields
from typing import Any

from engine.field_specs import value_bounds, value_type
from engine.sampling_params import SamplingParams

from service.config import GatewayConfig
from service.protocol import MAX_CACHE_SALT_CHARS, ROLES

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
    # transformers' values: a boolean or "never" (the one field whose type is not a single JSON type).
    "early_stopping": {"oneOf": [{"type": "boolean"}, {"enum": ["never"]}], "default": False},
    "model": {"type": "string"}, "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "include_stop_str_in_output": {"type": "boolean"}, "skip_special_tokens": {"type": "boolean"},
    "user": {"type": "string"}, "cache_salt": {"type": "string", "maxLength": MAX_CACHE_SALT_CHARS},
}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": sorted(ROLES)},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}}
_CHAT = {**_SAMPLING, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
         "max_completion_tokens": _MAX_TOKENS, "logprobs": {"type": "boolean"},
         "top_logprobs": _param(_PARAMS["logprobs"])}
_COMPLETION = {**_SAMPLING, "prompt": {"oneOf": [{"type": "string", "minLength": 1}, {
    "type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]},
               "logprobs": _param(_PARAMS["logprobs"])}
_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}
_ERROR_STATUSES = {"400": "invalid parameters or prompt too long", "401": "bad or missing API key",
                   "404": "unknown model, or (with Last-Event-ID) stream_not_found", "413": "body too large",
                   "429": "queue full (see Retry-After)",
                   "503": "Redis or every engine unavailable, or no engine took the request in time (see "
                          "Retry-After)"}
# A stream's SSE events carry ``id: <request id>:<k>``; sending the last one seen resumes the stream.
_LAST_EVENT_ID = {"name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "string"},
                  "description": "'<request id>:<k>' from a stream's 'id:' field: instead of a new run, the "
                                 "events of that stream after k (on any gateway, while the stream is retained)"}


def _generation_op(summary: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    errors = {code: {"description": text, "content": {"application/json": {"schema": _ERROR}}}
              for code, text in _ERROR_STATUSES.items()}
    ok = {"description": "a completion, or a text/event-stream of chunks ending with 'data: [DONE]'",
          "content": {"application/json": {}, "text/event-stream": {}}}
    return {"post": {"summary": summary, "parameters": [_LAST_EVENT_ID], "requestBody": {
        "required": True, "content": {"application/json": {
            "schema": {"type": "object", "required": required, "properties": properties}}}},
        "responses": {"200": ok, **errors}}}


def _resume_op() -> dict[str, Any]:
    errors = {code: {"description": text, "content": {"application/json": {"schema": _ERROR}}} for code, text in (
        ("400", "malformed Last-Event-ID"), ("401", "bad or missing API key"),
        ("404", "stream_not_found: unknown, another API key's, or past the retention window"),
        ("503", "Redis unavailable (see Retry-After)"))}
    request_id = {"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {"get": {"summary": "Resume a stream: its SSE events after Last-Event-ID (all without it), then live",
                    "parameters": [request_id, _LAST_EVENT_ID],
                    "responses": {"200": {"description": "text/event-stream", "content": {"text/event-stream": {}}},
                                  **errors}}}


def _get_op(summary: str, content_type: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK", "content": {content_type: {}}}}}}


def _with_server_caps(properties: dict[str, Any], model_name: str, config: GatewayConfig) -> dict[str, Any]:
    """The request fields as this server takes them: its model, and its caps on top of SamplingParams'."""
    capped = {**properties, "model": {"enum": [model_name]}, "n": {**properties["n"], "maximum": config.max_n},
              "best_of": {**properties["best_of"], "maximum": config.max_n},
              "stop": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": config.max_stop_string_len}, {
                  "type": "array", "maxItems": config.max_stop_strings,
                  "items": {"type": "string", "minLength": 1, "maxLength": config.max_stop_string_len}}]}}
    for name in ("logprobs", "top_logprobs"):
        if properties.get(name, {}).get("type") == "integer":
            capped[name] = {**properties[name], "maximum": min(properties[name]["maximum"], config.max_logprobs)}
    return capped


def openapi_document(model_name: str, config: GatewayConfig | None = None) -> dict[str, Any]:
    config = config or GatewayConfig()
    chat, completion = (_with_server_caps(p, model_name, config) for p in (_CHAT, _COMPLETION))
    return {
        "openapi": "3.1.0",
        "info": {"title": "pagedserve", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving {model_name!r}"},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": _generation_op("Chat completion", chat, ["model", "messages"]),
            "/v1/completions": _generation_op("Text completion", completion, ["model", "prompt"]),
            "/v1/streams/{request_id}": _resume_op(),
            "/v1/models": _get_op("The served model"),
            "/health": _get_op("Process alive (no API key needed)"),
            "/ready": _get_op("Redis reachable and an engine heartbeat fresh (503 otherwise)"),
            "/metrics": _get_op("Prometheus metrics", "text/plain"),
            "/openapi.json": _get_op("This document"),
        },
    }
