"""The OpenAPI 3.1 document served at /openapi.json (the routes and their
main fields; the full field semantics are OpenAI's, as read by vLLM). The
sampling fields' types, bounds and defaults come from SamplingParams, the
server's own caps (n and best_of, logprobs, stop strings) and the model name from the
gateway's config, and the rules between fields (one structured output source, beam search's
fixed fields, ...) are stated in the request schemas, so that a body the document allows is one
the server takes. What no JSON schema can state is named in the fields' descriptions: token ids
within the vocabulary, a prompt's length in tokens, min_tokens against max_tokens and n against
best_of (no schema compares two fields), a JSON schema / regex / grammar / JSON text that must
compile, unique tool names and a tool_choice naming one of them.

The document is also where authentication is declared: each operation's ``security`` (none on
``PUBLIC_PATHS``, which the gateway's auth lets through), with the 401 / 403 it answers."""
from __future__ import annotations

from dataclasses import MISSING, Field, fields
from typing import Any

from engine.field_specs import value_bounds, value_type
from engine.pooler_config import PoolerConfig
from engine.sampling_params import FIXED_BY_BEAM_SEARCH, SamplingParams
from engine.structured_output import MAX_CHOICES

from service import dashboard
from service.config import GatewayConfig
from service.openapi_images import ImageSchemas, image_schemas
from service.protocol import (_TEMPLATE_ARGS, EMBEDDING_ENCODINGS, MAX_CACHE_SALT_CHARS, MAX_EMBEDDING_INPUTS,
                              MAX_LOGIT_BIAS, MAX_PRIORITY, ROLES, SO_SOURCES)
from service.responses_api import TEXT_PARTS as RESPONSES_TEXT_PARTS
from service.tools import MAX_TOOLS, TOOL_NAME

# Routes that answer without an API key: the probes (Kubernetes' httpGet probes cannot send one; /ready
# says only ready or not, and why) and the dashboard's static files (no data: the page asks for a key).
PUBLIC_PATHS = frozenset({"/health", "/ready", *dashboard.PAGES})

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
_JSON_SCHEMA = {"oneOf": [{"type": "object"}, {"type": "string"}],
                "description": "a JSON schema (or its JSON text), which must compile"}
_REGEX = {"type": "string", "description": "a regular expression, which must compile"}
_CHOICE = {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"type": "string"}}
_GRAMMAR = {"type": "string", "description": "EBNF (xgrammar's / GBNF syntax), which must compile"}
_STRUCTURED = {  # at most one of these per request (_output_rule)
    "response_format": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                         "strict": {"type": ["boolean", "null"]},
                                                         "description": {"type": "string"}}}},
        "if": {"properties": {"type": {"const": "json_schema"}}}, "then": {"required": ["json_schema"]}},
    "guided_json": _JSON_SCHEMA, "guided_regex": _REGEX, "guided_choice": _CHOICE, "guided_grammar": _GRAMMAR,
    "structured_outputs": {
        "type": "object", "description": "vLLM's: exactly one of json, regex, choice, grammar, json_object: true",
        "properties": {"json": _JSON_SCHEMA, "regex": _REGEX, "choice": _CHOICE, "grammar": _GRAMMAR,
                       "json_object": {"type": "boolean"}},
        "additionalProperties": {"enum": [None, False]},  # any other key only unset
        "oneOf": [*({"required": [kind]} for kind in ("json", "regex", "choice", "grammar")),
                  {"required": ["json_object"], "properties": {"json_object": {"const": True}}}]},
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
        "arguments": {"oneOf": [{"type": "object"}, {
            "type": "string", "contentMediaType": "application/json", "contentSchema": {"type": "object"},
            "description": "a JSON object as text (or blank: no arguments)"}]}}}}}


def _messages(part: dict[str, Any]) -> dict[str, Any]:
    """Chat's messages, whose content is text or a list of ``part``s."""
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": sorted(ROLES)},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": part}, {"type": "null"}]},
        "name": {"type": "string"}, "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": _TOOL_CALL, "description": "assistant messages only"}},
        # Only an assistant's message may leave out its content (or carry tool calls).
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}},
                 "not": {"required": ["tool_calls"]}}}
    return {"type": "array", "minItems": 1, "items": message}


_MESSAGES = _messages(_TEXT_PART)  # a text-only model's
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"enum": ["function"]}, "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": f"^{TOOL_NAME.pattern}$",
                 "description": "unique among the request's tools"},
        "description": {"type": "string"}, "parameters": {"type": "object", "description": "a JSON schema, "
                                                                                         "which must compile"},
        "strict": {"type": "boolean"}}}}}
_TOOL_CHOICE = {"oneOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"enum": ["function"]}, "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "description": "one of the tools' names"}}}}}]}
_TOOL_FIELDS = {"tools": {"type": "array", "maxItems": MAX_TOOLS, "items": _TOOL}, "tool_choice": _TOOL_CHOICE,
                "parallel_tool_calls": {"type": "boolean"}}
_TEMPLATE_KWARGS = {"type": "object", "propertyNames": {"not": {"enum": sorted(_TEMPLATE_ARGS)}},
                    "description": "extra chat template variables, e.g. {\"enable_thinking\": false}; not "
                                   "apply_chat_template's own arguments"}
_CHAT = {**_SAMPLING, "messages": _MESSAGES,
         "max_completion_tokens": _MAX_TOKENS, "logprobs": {"type": "boolean"},
         "top_logprobs": _param(_PARAMS["logprobs"]), **_TOOL_FIELDS, "add_generation_prompt": {"type": "boolean"},
         "chat_template_kwargs": _TEMPLATE_KWARGS}
_TEXT_PROMPT = {"type": "string", "minLength": 1}
_ID_PROMPT = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}


def _prompts(listed: dict[str, Any]) -> dict[str, Any]:
    """A prompt (text or token ids), or a list of them (``listed``: that list's own keywords)."""
    return {"oneOf": [_TEXT_PROMPT, _ID_PROMPT, {"type": "array", "minItems": 1, **listed,
                                                 "items": {"oneOf": [_TEXT_PROMPT, _ID_PROMPT]}}]}


_COMPLETION = {**_SAMPLING, "prompt": _prompts({"description": "a list of prompts: choice k * n + i is choice i of "
                                                               "prompt k"}), "logprobs": _param(_PARAMS["logprobs"]),
    "echo": {"type": "boolean",
             "description": "the prompt (and, with logprobs, its tokens' logprobs) before the completion; with "
                            "max_tokens=0 the prompt alone; not with stream"},
    "suffix": {"const": "", "description": "not supported: only an empty suffix is accepted"}}


# ---- rules between fields --------------------------------------------------
# What service/protocol.py refuses across fields, in JSON Schema. Each rule is an anyOf whose branches fix
# properties (False: the field is left out), and the branches stay few: schema tools (schemathesis) expand
# the rules' product, and give up on a few dozen branches.
_UNCONSTRAINED_OUTPUT = {"response_format": {"properties": {"type": {"const": "text"}}},
                         **{name: False for name in SO_SOURCES if name != "response_format"}}
_NOT_FORCED = {"enum": ["none", "auto"]}  # any other tool_choice forces a call: its JSON is the output


def _branch(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    return {"properties": properties} | ({"required": list(required)} if required else {})


def _at_default(name: str, chat: bool) -> dict[str, Any]:
    """The properties that leave SamplingParams' ``name`` at its default (for the fields a body gives in
    another shape: left out, false, empty, or no source of a structured output)."""
    if name not in _NOT_SCALAR:
        return {name: {"const": _PARAMS[name].default}}
    return {"logprobs": {"logprobs": {"const": False} if chat else False},
            "prompt_logprobs": {"prompt_logprobs": False}, "logit_bias": {"logit_bias": {"maxProperties": 0}},
            "structured_output": _UNCONSTRAINED_OUTPUT | ({"tool_choice": _NOT_FORCED} if chat else {})}[name]


def _output_rule(chat: bool, config: GatewayConfig) -> dict[str, Any]:
    """What shapes the output, one of: beam search (its fixed fields at their defaults, no stream; best_of,
    the beam width, only with it), one source of a structured output, or (chat) a forced tool call.
    Without a tool-call parser, tool_choice "auto" (the default) is refused: tools are listed with a
    forced call only (the server also takes them with tool_choice "none")."""
    beam = {"use_beam_search": {"const": True}, "stream": {"const": False},
            **{k: v for name in FIXED_BY_BEAM_SEARCH for k, v in _at_default(name, chat).items()}}
    sampling = {"use_beam_search": {"const": False}, "best_of": False}  # (best_of equal to n is also taken)
    not_forced: dict[str, Any] = {}
    if chat:
        no_parser = config.tool_call_parser in (None, "none")
        not_forced = {"tool_choice": _NOT_FORCED} | ({"tools": {"maxItems": 0}} if no_parser else {})
    branches = [_branch(beam | not_forced, "use_beam_search"),
                *(_branch({**sampling, **not_forced, **{other: False for other in SO_SOURCES if other != source}})
                  for source in SO_SOURCES)]
    if chat:
        forced = {**sampling, **_UNCONSTRAINED_OUTPUT, "tool_choice": {"not": _NOT_FORCED}, "tools": {"minItems": 1}}
        branches.append(_branch(forced, "tool_choice", "tools"))
    return {"anyOf": branches}


def _stream_rule(chat: bool) -> dict[str, Any]:
    """prompt_logprobs (and a completion's echo) are not streamed; stream_options only come with a stream."""
    streamed = {"stream": {"const": True}, "prompt_logprobs": False, **({} if chat else {"echo": {"const": False}})}
    return {"anyOf": [_branch(streamed, "stream"), _branch({"stream": {"const": False}, "stream_options": False})]}


def _generation_rules(config: GatewayConfig, chat: bool) -> list[dict[str, Any]]:
    rules = [_output_rule(chat, config), _stream_rule(chat)]
    if chat:  # top_logprobs needs logprobs: true
        rules.append({"anyOf": [_branch({"top_logprobs": False}), _branch({"logprobs": {"const": True}}, "logprobs")]})
    return rules


# A forced call needs a tool to call (a tool_choice of "none" or "auto" without tools changes nothing).
_FORCED_CALL_NEEDS_TOOLS = {"anyOf": [_branch({"tool_choice": _NOT_FORCED}),
                                      _branch({"tools": {"minItems": 1}}, "tools")]}




def _tokenize(messages: dict[str, Any]) -> dict[str, Any]:
    """A prompt, or chat ``messages`` (a body with 'messages', whatever its value, is read as the chat form)."""
    return {"oneOf": [
        {"type": "object", "required": ["prompt"], "not": {"required": ["messages"]}, "properties": {
            "prompt": {"type": "string"}, "add_special_tokens": {"type": "boolean"}}},
        {"type": "object", "required": ["messages"], "properties": {
            "messages": messages, "add_generation_prompt": {"type": "boolean"}, **_TOOL_FIELDS,
            "chat_template_kwargs": _TEMPLATE_KWARGS}, "allOf": [_FORCED_CALL_NEEDS_TOOLS]}]}


_DETOKENIZE = {"type": "object", "required": ["tokens"], "properties": {
    "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0},
               "description": "ids within the vocabulary, at most the context length of them"}}}
_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}
# Answers of every route that reads a body: aiohttp's limit, and the body deadline (service/connections.py).
_BODY_ERRORS = {"408": "the body did not arrive within --body-timeout (the connection is closed)",
                "413": "body larger than --max-body-bytes"}
_GENERATION_ERRORS = {"400": "invalid parameters, or a prompt too long for the context",
                      "404": "unknown model, or (with Last-Event-ID) stream_not_found",
                      "429": "queue full, the tokenizer queue of this API key full, or the API key's concurrency "
                             "or token-rate limit reached (see Retry-After)",
                      "503": "Redis or every engine unavailable, or no engine took the request in time (see "
                             "Retry-After)", **_BODY_ERRORS}
_EMBEDDING_ERRORS = {**_GENERATION_ERRORS, "404": "unknown model",
                     "400": "invalid parameters, token ids outside the vocabulary, an input longer than the context, "
                            "or dimensions the model cannot give"}
_TOKENIZER_ERRORS = {"400": "invalid body, token ids outside the vocabulary, or more than the context holds",
                     "404": "unknown model", "429": "the tokenizer queue of this API key is full (see Retry-After)",
                     **_BODY_ERRORS}
# With X-Resumable (or --sse-event-ids) a stream's SSE events carry ``id: <request id>:<k>``; sending the last one
# seen resumes the stream. Without, the framing is OpenAI's and X-Request-Id names the stream.
REQUEST_ID_PATTERN = "(?:chatcmpl|cmpl)-[0-9a-f]{32}"  # the ids this server gives (a 400 or 404 for others)
_LAST_EVENT_ID = {"name": "Last-Event-ID", "in": "header", "required": False,
                  "schema": {"type": "string", "pattern": f"^{REQUEST_ID_PATTERN}:[0-9]{{1,9}}$"},
                  "description": "'<request id>:<k>' from a stream's 'id:' field: instead of a new run, the "
                                 "events of that stream after k (on any gateway, while the stream is retained)"}
_RESUMABLE = {"name": "X-Resumable", "in": "header", "required": False,
              "schema": {"type": "string", "enum": ["1", "0", "true", "false"]},
              "description": "'1': each SSE event carries an 'id: <request id>:<k>' line, for Last-Event-ID "
                             "(OpenAI's framing has none; the server's --sse-event-ids sends them always)"}
_STREAM_HEADERS = {"X-Request-Id": {"description": "the stream's request id: its k-th data event (from 0) "
                                                   "resumes as Last-Event-ID '<request id>:<k>'",
                                    "schema": {"type": "string", "pattern": f"^{REQUEST_ID_PATTERN}$"}}}
_DESCRIPTION = ("OpenAI-compatible API serving {model!r}. On any route: 405 with an Allow header for a method the "
                "path does not take; 429 too_many_connections, and the connection closed, for a client address "
                "past --max-connections-per-peer open connections.")


def _errors(statuses: dict[str, str]) -> dict[str, Any]:
    """Responses in OpenAI's error shape, by status."""
    return {code: {"description": text, "content": {"application/json": {"schema": _ERROR}}}
            for code, text in statuses.items()}


def _generation_op(summary: str, properties: dict[str, Any], required: list[str],
                   rules: list[dict[str, Any]], errors: dict[str, str] = _GENERATION_ERRORS) -> dict[str, Any]:
    ok = {"description": "a completion, or a text/event-stream of chunks ending with 'data: [DONE]' (': keep-alive' "
                         "comments while no chunk flows)",
          "content": {"application/json": {}, "text/event-stream": {}}, "headers": _STREAM_HEADERS}
    schema = {"type": "object", "required": required, "properties": properties, "allOf": rules}
    return {"post": {"summary": summary, "parameters": [_LAST_EVENT_ID, _RESUMABLE], "requestBody": {
        "required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": ok, **_errors(errors)}}}


def _resume_op() -> dict[str, Any]:
    errors = _errors({"400": "malformed Last-Event-ID",
                      "404": "stream_not_found: unknown, another API key's, or past the retention window",
                      "503": "Redis unavailable (see Retry-After)"})
    request_id = {"name": "request_id", "in": "path", "required": True,
                  "schema": {"type": "string", "pattern": f"^{REQUEST_ID_PATTERN}$"}}
    return {"get": {"summary": "Resume a stream: its SSE events after Last-Event-ID (all without it), then live",
                    "parameters": [request_id, _LAST_EVENT_ID],
                    "responses": {"200": {"description": "text/event-stream", "content": {"text/event-stream": {}}},
                                  **errors}}}


def _post_op(summary: str, schema: dict[str, Any], answer: str,
             errors: dict[str, str] = _TOKENIZER_ERRORS) -> dict[str, Any]:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}}}, "responses": {"200": {"description": answer, "content": {
            "application/json": {}}}, **_errors(errors)}}}


def _embeddings_schema(model_name: str, pooler: PoolerConfig | None) -> dict[str, Any]:
    """OpenAI's embeddings body as this server takes it (service.protocol.parse_embeddings)."""
    return {"type": "object", "required": ["input"], "properties": {
        "model": {"enum": [model_name]}, "user": {"type": "string"},
        "input": _prompts({"maxItems": MAX_EMBEDDING_INPUTS, "description": "one vector per input, in order"}),
        "encoding_format": {"enum": list(EMBEDDING_ENCODINGS), "default": "float",
                            "description": "base64: of the vector's float32 little-endian bytes"},
        "dimensions": _dimensions(pooler)}}


def _dimensions(pooler: PoolerConfig | None) -> dict[str, Any]:
    """The Matryoshka dimensions the checkpoint gives (PoolerConfig.check_dimensions' rule): the vector's first
    ``dimensions``, normalized again."""
    if pooler is None or not pooler.is_matryoshka:
        return {"not": {}, "description": "not taken: the checkpoint's config.json sets neither is_matryoshka nor "
                                          "matryoshka_dimensions"}
    if pooler.matryoshka_dimensions:
        return {"enum": [d for d in pooler.matryoshka_dimensions if 1 <= d <= pooler.hidden_size]}
    return {"type": "integer", "minimum": 1, "maximum": pooler.hidden_size}


_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
_BLOCKS = {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}}}


def _messages_schema(model_name: str, count_only: bool, image: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's Messages body as this server takes it (service.anthropic_api); ``image``: its image block."""
    block = _BLOCKS["items"] if image is None else {"oneOf": [image, {**_BLOCKS["items"], "properties": {
        "type": {"type": "string", "not": {"const": "image"}}}}]}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["user", "assistant"]}, "content": {"type": ["string", "array"], "items": block}}}
    properties = {
        "model": {"enum": [model_name]}, "messages": {"type": "array", "minItems": 1, "items": message},
        "system": {"type": ["string", "array"], "items": _BLOCKS["items"]},
        "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"]}},
        "tool_choice": {"type": "object", "required": ["type"],
                        "properties": {"type": {"enum": ["auto", "any", "tool", "none"]}}}}
    if not count_only:
        properties |= {"max_tokens": {"type": "integer", "minimum": 1}, "stream": {"type": "boolean"},
                       "stop_sequences": {"type": "array", "items": {"type": "string"}},
                       "temperature": {"type": "number", "minimum": 0}, "top_p": {"type": "number"},
                       "top_k": {"type": "integer"}, "output_config": {"type": "object"}}
    return {"type": "object", "required": ["messages"] if count_only else ["max_tokens", "messages"],
            "properties": properties}


def _translated_op(summary: str, schema: dict[str, Any], answer: str, error: dict[str, Any],
                   statuses: dict[str, str]) -> dict[str, Any]:
    """An API translated onto the chat path: its body, its answer (whole or streamed), its errors' shape."""
    errors = {code: {"description": text, "content": {"application/json": {"schema": error}}}
              for code, text in statuses.items()}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}}}, "responses": {"200": {"description": answer, "content": {
            "application/json": {}, "text/event-stream": {}}}, **errors}}}


def _responses_schema(model_name: str, image: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's Responses body as this server takes it (service.responses_api); ``image``: its input_image part."""
    content: dict[str, Any] = {"type": ["string", "array"]}
    if image is not None:
        text = {"type": "object", "required": ["type", "text"], "properties": {
            "type": {"enum": list(RESPONSES_TEXT_PARTS)}, "text": {"type": "string"}}}
        content = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [text, image]}}]}
    item = {"type": "object", "properties": {
        "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"]},
        "role": {"enum": ["user", "assistant", "system", "developer"]}, "content": content}}
    return {"type": "object", "required": ["input"], "properties": {
        "model": {"enum": [model_name]}, "input": {"type": ["string", "array"], "minItems": 1, "items": item},
        "instructions": {"type": "string"}, "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2}, "top_p": {"type": "number"},
        "stream": {"type": "boolean"}, "parallel_tool_calls": {"type": "boolean"},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"],
                                             "properties": {"type": {"const": "function"}}}},
        "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required"]}, {"type": "object",
                                                                          "required": ["type", "name"]}]},
        "text": {"type": "object"}, "store": {"type": "boolean", "default": True},
        "previous_response_id": {"type": "string"},
        "background": {"const": False, "description": "background responses are not supported"}}}


def _stored_response_ops() -> dict[str, dict[str, Any]]:
    """GET and DELETE /v1/responses/{response_id}, and its cancel (only background responses could be)."""
    path = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    missing = {"404": "response_not_found: unknown, another API key's, or past --response-ttl",
               "503": "Redis unavailable (see Retry-After)"}
    ok = {"200": {"description": "OK", "content": {"application/json": {}}}}
    return {"/v1/responses/{response_id}": {
                "get": {"summary": "A stored response", "parameters": path, "responses": ok | _errors(missing)},
                "delete": {"summary": "Delete a stored response", "parameters": path,
                           "responses": ok | _errors(missing)}},
            "/v1/responses/{response_id}/cancel": {"post": {
                "summary": "Cancel a background response (none runs here: a 400 for a stored one)",
                "parameters": path, "responses": _errors({"400": "not a background response", **missing})}}}


def _get_op(summary: str, content_type: str = "application/json",
            errors: dict[str, str] | None = None) -> dict[str, Any]:
    ok = {"200": {"description": "OK", "content": {content_type: {}}}}
    return {"get": {"summary": summary, "responses": ok | _errors(errors or {})}}


def _model_op(model_name: str) -> dict[str, Any]:
    model = {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "enum": [model_name]}}
    op = _get_op("The served model's card", errors={"404": "model_not_found: not the served model"})
    op["get"]["parameters"] = [model]
    return op


def _kv_snapshot_op() -> dict[str, Any]:
    engine = {"name": "engine", "in": "query", "required": False, "schema": {"type": "string"},
              "description": "a live engine's id (default: the first); the answer lists them"}
    errors = _errors({"404": "engine_not_found: no such live engine",
                      "503": "no live engine, or Redis unavailable (see Retry-After)"})
    ok = {"description": "{object, engines, engine, snapshot}: snapshot is the engine's KV pools block by block "
                         "(arrays as base64 of little-endian bytes), its requests and EngineStats of the same "
                         "step, or null until the engine publishes one (asking makes it publish for a few seconds)",
          "content": {"application/json": {}}}
    return {"get": {"summary": "An engine's KV pool, block by block (the dashboard's)", "parameters": [engine],
                    "responses": {"200": ok, **errors}}}


def _dashboard_ops() -> dict[str, Any]:
    return {path: _get_op(f"The live KV pool dashboard's {name} (no data: the page asks for an API key and sends "
                          "it with each snapshot fetch)", content_type)
            for path, (name, content_type) in dashboard.PAGES.items()}


def _with_image_errors(statuses: dict[str, str], images: ImageSchemas | None) -> dict[str, str]:
    """A route's error statuses with what the image rules answer (a vision-language model's) added."""
    if images is None:
        return statuses
    return statuses | {code: f"{statuses[code]}; {text}" for code, text in images.errors.items()}


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


def _for_model(schema: dict[str, Any], model_name: str) -> dict[str, Any]:
    """A request body whose optional 'model' must name the served model (another is a 404)."""
    return schema | {"properties": {**schema.get("properties", {}), "model": {"enum": [model_name]}}}


def _with_auth(path: str, operation: dict[str, Any], config: GatewayConfig) -> dict[str, Any]:
    """The operation with its security as the gateway's auth applies it: none on PUBLIC_PATHS or on a
    server without keys, else a bearer key (401 without a valid one; /metrics, once admin keys are set,
    403 for a tenant's key)."""
    if path in PUBLIC_PATHS or not config.all_keys:
        return operation | {"security": []}
    refusals = {"401": "invalid_api_key: bad or missing API key"}
    if path == "/metrics" and config.admin_keys:
        refusals["403"] = "admin_key_required: the totals over every tenant need an admin key"
    return operation | {"security": [{"bearer": []}], "responses": {**operation["responses"], **_errors(refusals)}}


def openapi_document(model_name: str, config: GatewayConfig | None = None, pooler: PoolerConfig | None = None,
                     takes_images: bool = False) -> dict[str, Any]:
    """``takes_images``: a vision-language model's, whose chats (and /tokenize) take image parts."""
    config = config or GatewayConfig()
    images = image_schemas(config) if takes_images else None
    messages = _MESSAGES if images is None else _messages({"oneOf": [_TEXT_PART, images.chat_part]})
    chat, completion = (_with_server_caps(p, model_name, config) for p in ({**_CHAT, "messages": messages},
                                                                          _COMPLETION))
    chat_errors = _with_image_errors(_GENERATION_ERRORS, images)
    block, input_image = (None, None) if images is None else (images.anthropic_block, images.input_image)
    paths = {
        "/v1/chat/completions": _generation_op("Chat completion", chat, ["messages"],
                                               _generation_rules(config, chat=True), chat_errors),
        "/v1/completions": _generation_op("Text completion", completion, ["prompt"],
                                          _generation_rules(config, chat=False)),
        "/v1/embeddings": _post_op("Embeddings: a vector per input, pooled as the checkpoint says",
                                   _embeddings_schema(model_name, pooler), "{object: list, data: [{object: embedding, index, "
                                   "embedding}], model, usage}", _EMBEDDING_ERRORS),
        "/v1/streams/{request_id}": _resume_op(),
        "/v1/messages": _translated_op("Anthropic Messages: a message, or its stream of events",
                                       _messages_schema(model_name, False, block),
                                       "a message, or a text/event-stream of Anthropic's events", _ANTHROPIC_ERROR,
                                       chat_errors),
        "/v1/messages/count_tokens": _translated_op("Anthropic Messages: the input's token count (an image's "
                                                    "tokens too)",
                                                    _messages_schema(model_name, True, block),
                                                    "{input_tokens}", _ANTHROPIC_ERROR, chat_errors),
        "/v1/responses": _translated_op("OpenAI Responses: a response, or its stream of events",
                                        _responses_schema(model_name, input_image),
                                        "a Response, or a text/event-stream of the Responses events", _ERROR,
                                        chat_errors),
        **_stored_response_ops(),
        "/tokenize": _post_op("Token ids of a prompt, or of messages through the chat template (each image's "
                              "placeholder as many tokens as the image has: the chat's prompt_tokens)",
                              _for_model(_tokenize(messages), model_name), "{tokens, count, max_model_len}",
                              _with_image_errors(_TOKENIZER_ERRORS, images)),
        "/detokenize": _post_op("The text of token ids", _for_model(_DETOKENIZE, model_name), "{prompt}"),
        "/v1/models": _get_op("The served model"),
        "/v1/models/{model}": _model_op(model_name),
        "/health": _get_op("Process alive"),
        "/ready": _get_op("Redis reachable and an engine heartbeat fresh",
                          errors={"503": "{status: unavailable, reason}: not ready, and why"}),
        "/metrics": _get_op("Prometheus metrics", "text/plain"),
        "/openapi.json": _get_op("This document"),
        "/v1/kv_snapshot": _kv_snapshot_op(),
        **_dashboard_ops(),
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "pagedserve", "version": "0.1.0", "description": _DESCRIPTION.format(model=model_name)},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {path: {method: _with_auth(path, operation, config) for method, operation in item.items()}
                  for path, item in paths.items()},
    }
