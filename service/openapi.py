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
from service.protocol import MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, MAX_PRIORITY, ROLES

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
# SamplingParams fields a body gives in another shape (the structured output through the fields below).
_NOT_SCALAR = {"logprobs", "structured_output", "logit_bias", "prompt_logprobs"}
_JSON_SCHEMA = {"oneOf": [{"type": "object"}, {"type": "string"}], "description": "a JSON schema (or its JSON text)"}
_STRUCTURED = {  # at most one of these per request
    "response_format": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                         "strict": {"type": ["boolean", "null"]},
                                                         "description": {"type": "string"}}}}},
    "guided_json": _JSON_SCHEMA, "guided_regex": {"type": "string"},
    "guided_choice": {"type": "array", "minItems": 1, "items": {"type": "string"}},
    "guided_grammar": {"type": "string", "description": "EBNF (xgrammar's / GBNF syntax)"},
    "structured_outputs": {"type": "object", "description": "vLLM's: one of the properties", "properties": {
        "json": _JSON_SCHEMA, "regex": {"type": "string"}, "choice": {"type": "array", "items": {"type": "string"}},
        "grammar": {"type": "string"}, "json_object": {"type": "boolean"}}},
}
_SAMPLING = {
    **{name: _param(f) for name, f in _PARAMS.items() if name not in _NOT_SCALAR}, "max_tokens": _MAX_TOKENS,
    **_STRUCTURED, "prompt_logprobs": _param(_PARAMS["logprobs"], with_default=False),
    "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]{1,12}$"},
                   "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}},
    # transformers' values: a boolean or "never" (the one field whose type is not a single JSON type).
    "early_stopping": {"oneOf": [{"type": "boolean"}, {"enum": ["never"]}], "default": False},
    "model": {"type": "string"}, "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "include_stop_str_in_output": {"type": "boolean"}, "skip_special_tokens": {"type": "boolean"},
    "user": {"type": "string"}, "cache_salt": {"type": "string", "maxLength": MAX_CACHE_SALT_CHARS},
    "priority": {"type": "integer", "minimum": -MAX_PRIORITY, "maximum": MAX_PRIORITY,
                 "description": "lower is scheduled first and preempted last (vLLM's); the API key's is added"},
}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1},
        "arguments": {"type": "string", "description": "a JSON object as text"}}}}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": sorted(ROLES)},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
    "name": {"type": "string"}, "tool_call_id": {"type": "string"},
    "tool_calls": {"type": "array", "items": _TOOL_CALL, "description": "assistant messages only"}}}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"enum": ["function"]}, "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"},
        "strict": {"type": "boolean"}}}}}
_TEMPLATE_KWARGS = {"type": "object", "description": "extra chat template variables, e.g. {\"enable_thinking\": false}"}
_CHAT = {**_SAMPLING, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
         "max_completion_tokens": _MAX_TOKENS, "logprobs": {"type": "boolean"},
         "top_logprobs": _param(_PARAMS["logprobs"]), "tools": {"type": "array", "items": _TOOL},
         "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {
             "type": "object", "required": ["type", "function"], "properties": {
                 "type": {"enum": ["function"]}, "function": {"type": "object", "required": ["name"],
                                                              "properties": {"name": {"type": "string"}}}}}]},
         "parallel_tool_calls": {"type": "boolean"}, "add_generation_prompt": {"type": "boolean"},
         "chat_template_kwargs": _TEMPLATE_KWARGS}
_TEXT_PROMPT = {"type": "string", "minLength": 1}
_ID_PROMPT = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_COMPLETION = {**_SAMPLING, "prompt": {"oneOf": [_TEXT_PROMPT, _ID_PROMPT, {
    "type": "array", "minItems": 1, "description": "a list of prompts: choice k * n + i is choice i of prompt k",
    "items": {"oneOf": [_TEXT_PROMPT, _ID_PROMPT]}}]}, "logprobs": _param(_PARAMS["logprobs"]),
    "echo": {"type": "boolean",
             "description": "the prompt (and, with logprobs, its tokens' logprobs) before the completion; with "
                            "max_tokens=0 the prompt alone; not with stream"}}
_TOKENIZE = {"oneOf": [
    {"type": "object", "required": ["prompt"], "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string"}, "add_special_tokens": {"type": "boolean"}}},
    {"type": "object", "required": ["messages"], "properties": {
        "model": {"type": "string"}, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "add_generation_prompt": {"type": "boolean"}, "tools": {"type": "array", "items": _TOOL},
        "chat_template_kwargs": _TEMPLATE_KWARGS}}]}
_DETOKENIZE = {"type": "object", "required": ["tokens"], "properties": {
    "model": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}
_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}
_ERROR_STATUSES = {"400": "invalid parameters or prompt too long", "401": "bad or missing API key",
                   "404": "unknown model, or (with Last-Event-ID) stream_not_found", "413": "body too large",
                   "429": "queue full, or the API key's concurrency or token-rate limit reached (see "
                          "Retry-After)",
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


def _post_op(summary: str, schema: dict[str, Any], answer: str) -> dict[str, Any]:
    errors = {code: {"description": text, "content": {"application/json": {"schema": _ERROR}}}
              for code, text in (("400", "invalid body, or token ids outside the vocabulary"),
                                 ("401", "bad or missing API key"), ("404", "unknown model"))}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}}}, "responses": {"200": {"description": answer, "content": {
            "application/json": {}}}, **errors}}}


def _get_op(summary: str, content_type: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK", "content": {content_type: {}}}}}}


def _kv_snapshot_op() -> dict[str, Any]:
    engine = {"name": "engine", "in": "query", "required": False, "schema": {"type": "string"},
              "description": "a live engine's id (default: the first); the answer lists them"}
    errors = {code: {"description": text, "content": {"application/json": {"schema": _ERROR}}} for code, text in (
        ("401", "bad or missing API key"), ("404", "engine_not_found: no such live engine"),
        ("503", "no live engine, or Redis unavailable (see Retry-After)"))}
    ok = {"description": "{object, engines, engine, snapshot}: snapshot is the engine's KV pools block by block "
                         "(arrays as base64 of little-endian bytes), its requests and EngineStats of the same "
                         "step, or null until the engine publishes one (asking makes it publish for a few seconds)",
          "content": {"application/json": {}}}
    return {"get": {"summary": "An engine's KV pool, block by block (the dashboard's)", "parameters": [engine],
                    "responses": {"200": ok, **errors}}}


def _with_server_caps(properties: dict[str, Any], model_name: str, config: GatewayConfig) -> dict[str, Any]:
    """The request fields as this server takes them: its model, and its caps on top of SamplingParams'."""
    capped = {**properties, "model": {"enum": [model_name]}, "n": {**properties["n"], "maximum": config.max_n},
              "best_of": {**properties["best_of"], "maximum": config.max_n},
              "logit_bias": {**properties["logit_bias"], "maxProperties": config.max_logit_bias},
              "stop": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": config.max_stop_string_len}, {
                  "type": "array", "maxItems": config.max_stop_strings,
                  "items": {"type": "string", "minLength": 1, "maxLength": config.max_stop_string_len}}]}}
    if "echo" in properties:  # completions: a list of prompts is capped
        listed = properties["prompt"]["oneOf"][2]
        capped["prompt"] = {"oneOf": [*properties["prompt"]["oneOf"][:2], {**listed, "maxItems": config.max_prompts}]}
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
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
            "/tokenize": _post_op("Token ids of a prompt, or of messages through the chat template", _TOKENIZE,
                                  "{tokens, count, max_model_len}"),
            "/detokenize": _post_op("The text of token ids", _DETOKENIZE, "{prompt}"),
            "/v1/models": _get_op("The served model"),
            "/health": _get_op("Process alive (no API key needed)"),
            "/ready": _get_op("Redis reachable and an engine heartbeat fresh (503 otherwise)"),
            "/metrics": _get_op("Prometheus metrics", "text/plain"),
            "/openapi.json": _get_op("This document"),
            "/v1/kv_snapshot": _kv_snapshot_op(),
            "/dashboard": _get_op("The live KV pool dashboard, a page (no API key needed: it asks for one and "
                                  "sends it with each snapshot fetch)", "text/html"),
        },
    }
