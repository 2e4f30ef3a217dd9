"""OpenAI request parsing and validation, vLLM's reading of the fields.

Everything a client can get wrong is caught here and raised as ``APIError``
(a 4xx with OpenAI's error body) before anything reaches Redis.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any

from engine.context_length import ContextLengthError, check_input_length, fit_max_tokens
from engine.field_specs import value_type
from engine.multimodal.inputs import ImagePatches
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputParams

from service.config import GatewayConfig
from service.errors import APIError
from service.tools import ToolRequest, parse_tool_request

log = logging.getLogger(__name__)

ROLES = {"system", "developer", "user", "assistant", "tool"}
_PARAMS = {f.name: f for f in fields(SamplingParams)}
# SamplingParams fields read by hand below (caps, aliases, chat's boolean logprobs); a body sets every
# other one under its own name, with its type and default.
_BY_HAND = {"n", "max_tokens", "logprobs", "stop_token_ids", "early_stopping", "structured_output", "logit_bias",
            "prompt_logprobs"}
EARLY_STOPPING = (True, False, "never")  # transformers' values (a bool or a string on the wire)
# Fields that exist in the OpenAI API and are read below; anything else is logged and ignored.
# Where a structured output can come from (OpenAI's response_format, vLLM's guided_* and structured_outputs):
# at most one per request.
SO_SOURCES = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "structured_outputs")
_COMMON = (set(_PARAMS) - {"structured_output"}) | {
    "model", "stream", "stream_options", "stop", "include_stop_str_in_output", "skip_special_tokens", "user",
    "cache_salt", "logit_bias", "prompt_logprobs", "priority", *SO_SOURCES}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt", "tools",
                   "tool_choice", "parallel_tool_calls", "functions", "function_call", "chat_template_kwargs"}
_COMPLETION = _COMMON | {"prompt", "echo", "suffix"}
# apply_chat_template's own arguments: chat_template_kwargs may not set them.
_TEMPLATE_ARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                  "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                  "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
MAX_LOGIT_BIAS = 100.0
MAX_CACHE_SALT_CHARS = 256
MAX_PRIORITY = 2**31 - 1  # vLLM's priority is an int; a bound keeps it one on every wire
MAX_JSON_DEPTH = 32  # a chat body needs 4 (body, messages, message, content parts)
EMBEDDING_ENCODINGS = ("float", "base64")
# OpenAI's image detail levels: accepted and ignored (the checkpoint's image processor sets the resolution).
IMAGE_DETAILS = ("auto", "low", "high")
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs
_EMBEDDINGS = {"input", "model", "encoding_format", "dimensions", "user"}  # user: accepted, without effect


@dataclass(slots=True)
class GenerationRequest:
    """A validated request; ``params.max_tokens`` is None until the prompt's length is known."""

    chat: bool
    model: str | None  # None: the served model
    params: SamplingParams
    messages: list[dict[str, Any]] = field(default_factory=list)
    # Completions: every prompt of the body, one engine request each; ``prompt`` is the one this request runs.
    prompts: list[str | list[int]] = field(default_factory=list)
    prompt: str | list[int] = ""
    add_generation_prompt: bool = True
    tools: ToolRequest | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    echo: bool = False
    echo_only: bool = False  # max_tokens=0 with echo: the engine's one token is not part of the answer
    prompt_logprobs: int | None = None  # vLLM's extra, as asked (params.prompt_logprobs may be more, for echo)
    structured_output_param: str | None = None  # the field it came from, for a 400's param
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    include_usage: bool = False
    want_logprobs: bool = False
    cache_salt: str | None = None
    priority: int = 0  # vLLM's: lower is scheduled first; the API key's priority is added by the gateway
    # An embedding request: its prompt's prefill only, answered with a vector (``params`` then samples nothing).
    pooling: PoolingParams | None = None
    encoding_format: str = "float"  # an embedding's, in the response: "float" or "base64"
    images: list[ImagePatches] = field(default_factory=list)  # a chat's, preprocessed by the gateway (images.py)

    def budget(self, num_prompt_tokens: int) -> int:
        """The tokens charged to the API key at admission: the prompt, and max_tokens per choice."""
        return num_prompt_tokens + (0 if self.pooling is not None else self.params.max_tokens * self.params.n)


@dataclass(slots=True)
class TokenizeRequest:
    """vLLM's /tokenize: a prompt, or messages rendered by the chat template."""

    model: str | None
    prompt: str = ""
    add_special_tokens: bool = True
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    tools: ToolRequest | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_tokenize(body: Any) -> TokenizeRequest:
    body = require_object(body)
    req = TokenizeRequest(_get(body, "model", str, None))
    if "messages" in body:
        req.messages = _parse_messages(body["messages"])
        req.add_generation_prompt = _get(body, "add_generation_prompt", bool, True)
        req.tools = parse_tool_request(body)
        req.chat_template_kwargs = _parse_template_kwargs(body.get("chat_template_kwargs"))
        return req
    req.prompt = _get(body, "prompt", str, None)
    if req.prompt is None:
        raise APIError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
    req.add_special_tokens = _get(body, "add_special_tokens", bool, True)
    return req


def parse_detokenize(body: Any) -> tuple[str | None, list[int]]:
    body = require_object(body)
    tokens = _token_ids(body.get("tokens"))
    if tokens is None:
        raise APIError(400, "'tokens' must be a list of token ids", param="tokens")
    return _get(body, "model", str, None), tokens


def parse_json(raw: bytes) -> Any:
    """A request body as JSON: NaN, infinities and nesting past ``MAX_JSON_DEPTH`` are client errors."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        body = None  # nested past the parser's own stack: certainly too deep
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, integers of more than 4,300 digits
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if body is None or _nested_deeper(body, MAX_JSON_DEPTH):
        raise APIError(400, f"the request body is not a JSON object nested at most {MAX_JSON_DEPTH} levels deep")
    if (b"\\u" in raw or b"\xed" in raw) and not _encodable(body):  # only an escape or raw bytes make one
        raise APIError(400, "the request body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                            "escape): text must be valid Unicode", code="invalid_unicode")
    return body


def _encodable(value: Any) -> bool:
    """Whether every string in ``value`` (keys too) encodes as UTF-8: no lone surrogates, which every later
    hop (msgpack, the tokenizer, the response) would fail on."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_encodable(k) and _encodable(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_encodable(v) for v in value)
    return True


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of the range of a double")
    return value


def _nested_deeper(value: Any, limit: int) -> bool:
    """Level by level, without recursion; only containers are followed."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list))]
        if not level:
            return False
    return True


def parse_chat(body: Any, config: GatewayConfig) -> GenerationRequest:
    body = require_object(body)
    _log_unknown(body, _CHAT)
    tools = parse_tool_request(body)
    want = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int, None)
    if top is not None and not want:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    max_tokens = _get(body, "max_completion_tokens", int, None)
    max_tokens = _get(body, "max_tokens", int, None) if max_tokens is None else max_tokens
    request = _parse_common(body, config, chat=True, max_tokens=max_tokens,
                            logprobs=(top or 0) if want else None, tools=tools)
    request.messages = _parse_messages(body.get("messages"))
    request.add_generation_prompt = _get(body, "add_generation_prompt", bool, True)
    request.chat_template_kwargs = _parse_template_kwargs(body.get("chat_template_kwargs"))
    return request


def parse_completion(body: Any, config: GatewayConfig) -> GenerationRequest:
    body = require_object(body)
    _log_unknown(body, _COMPLETION)
    if _get(body, "suffix", str, None):
        raise APIError(400, "suffix is not supported by this server", param="suffix")
    echo = _get(body, "echo", bool, False)
    if echo and _get(body, "stream", bool, False):
        raise APIError(400, "echo cannot be streamed by this server (use stream=false)", param="echo")
    max_tokens = _read(body, _PARAMS["max_tokens"])
    echo_only = echo and max_tokens == 0  # vLLM's scoring request: the prompt's logprobs, nothing generated
    request = _parse_common(body, config, chat=False, max_tokens=1 if echo_only else max_tokens,
                            logprobs=_get(body, "logprobs", int, None), echo=echo)
    request.echo, request.echo_only = echo, echo_only
    request.prompts = parse_prompts(body.get("prompt"), "prompt", config.max_prompts)
    request.prompt = request.prompts[0]
    return request


def parse_embeddings(body: Any) -> GenerationRequest:
    """An embeddings body: its inputs as ``prompts`` (one engine request each), ``dimensions`` as its pooling
    (checked against the model by the gateway)."""
    body = require_object(body)
    _log_unknown(body, _EMBEDDINGS)
    encoding = _get(body, "encoding_format", str, "float")
    if encoding not in EMBEDDING_ENCODINGS:
        raise APIError(400, f"encoding_format must be one of {', '.join(EMBEDDING_ENCODINGS)}, got {encoding[:20]!r}",
                       param="encoding_format")
    prompts = parse_prompts(body.get("input"), "input", MAX_EMBEDDING_INPUTS)
    # params: the run's one choice, which the final event ends (the engine samples nothing for a pooling request)
    return GenerationRequest(chat=False, model=_get(body, "model", str, None), params=SamplingParams(max_tokens=1),
                             prompts=prompts, prompt=prompts[0], encoding_format=encoding,
                             pooling=PoolingParams(dimensions=_get(body, "dimensions", int, None)))


def _parse_common(body: dict[str, Any], config: GatewayConfig, chat: bool, max_tokens: int | None,
                  logprobs: int | None, tools: ToolRequest | None = None, echo: bool = False) -> GenerationRequest:
    model = _get(body, "model", str, None)  # absent: the served model (as vLLM serves its one model)
    n = _read(body, _PARAMS["n"])
    _check_cap("n", n, config.max_n)
    if logprobs is not None:
        _check_cap("top_logprobs" if chat else "logprobs", logprobs, config.max_logprobs)
    best_of = _read(body, _PARAMS["best_of"])
    if best_of is not None:
        _check_cap("best_of", best_of, config.max_n)
    stream = _get(body, "stream", bool, False)
    beam = _read(body, _PARAMS["use_beam_search"])
    if stream and beam:
        raise APIError(400, "beam search returns its beams once it is over: it cannot be streamed "
                            "(use_beam_search needs stream=false)", param="use_beam_search")
    so, so_param = _parse_structured_output(body, tools)
    prompt_logprobs = _get(body, "prompt_logprobs", int, None)
    if prompt_logprobs is not None:
        _check_cap("prompt_logprobs", prompt_logprobs, config.max_logprobs)
        if stream:
            raise APIError(400, "prompt_logprobs cannot be streamed by this server (use stream=false)",
                           param="prompt_logprobs")
    extras = {"structured_output": so, "logit_bias": _parse_logit_bias(body.get("logit_bias"), config),
              # echo with logprobs reports the prompt's tokens too: the engine computes the larger of the two
              "prompt_logprobs": max(prompt_logprobs or 0, logprobs) if echo and logprobs is not None
              else prompt_logprobs}
    if beam and (used := next((name for name, v in extras.items() if v is not None), None)):
        raise APIError(400, f"{so_param or used} is not supported with use_beam_search", param=so_param or used)
    return GenerationRequest(
        chat=chat, model=model, stream=stream, params=_sampling_params(body, n, max_tokens, logprobs, extras),
        stop=_parse_stop(body.get("stop"), config),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
        skip_special_tokens=_get(body, "skip_special_tokens", bool, not (chat and _harmony(config))),
        include_usage=_parse_stream_options(body.get("stream_options"), stream),
        want_logprobs=logprobs is not None, cache_salt=_parse_cache_salt(body), tools=tools,
        priority=_parse_priority(body),
        prompt_logprobs=prompt_logprobs, structured_output_param=so_param)


def _harmony(config: GatewayConfig) -> bool:
    """gpt-oss's parsers read its channels off its special tokens: its chat output keeps them by default."""
    return "gpt_oss" in (config.reasoning_parser, config.tool_call_parser)


def _parse_priority(body: dict[str, Any]) -> int:
    priority = _get(body, "priority", int, 0)
    if abs(priority) > MAX_PRIORITY:
        raise APIError(400, f"priority must be within [-{MAX_PRIORITY}, {MAX_PRIORITY}]", param="priority")
    return priority


def _parse_cache_salt(body: dict[str, Any]) -> str | None:
    salt = _get(body, "cache_salt", str, None)
    if salt is not None and len(salt) > MAX_CACHE_SALT_CHARS:
        raise APIError(400, f"cache_salt is limited to {MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
    return salt


def _sampling_params(body: dict[str, Any], n: int, max_tokens: int | None, logprobs: int | None,
                     extras: dict[str, Any]) -> SamplingParams:
    stop_ids = _token_ids(_get(body, "stop_token_ids", list, []))
    if stop_ids is None:
        raise APIError(400, "stop_token_ids must be a list of integers", param="stop_token_ids")
    fields_read = {name: _read(body, f) for name, f in _PARAMS.items() if name not in _BY_HAND}
    if fields_read["use_beam_search"] and "temperature" not in body:
        fields_read["temperature"] = 0.0  # beam search scores the raw distribution unless asked otherwise
    try:
        return SamplingParams(n=n, max_tokens=max_tokens, logprobs=logprobs, stop_token_ids=stop_ids,
                              early_stopping=_parse_early_stopping(body), **extras, **fields_read)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=name if name in body else None) from exc


def _parse_early_stopping(body: dict[str, Any]) -> bool | str:
    value = body.get("early_stopping")
    if value is None:
        return False
    if not any(value is v or (isinstance(value, str) and value == v) for v in EARLY_STOPPING):
        raise APIError(400, "early_stopping must be true, false or \"never\"", param="early_stopping")
    return value


def _parse_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    return [_parse_message(i, m) for i, m in enumerate(messages)]


def _parse_message(i: int, message: Any) -> dict[str, Any]:
    """A message as transformers' chat templates take it: text content (None becomes ""), an assistant's
    tool_calls with their arguments as dicts, a tool result's tool_call_id, and any message's name."""
    param = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or message["role"] not in ROLES:
        raise APIError(400, f"{param} must be an object with a role in {sorted(ROLES)}", param=param)
    role, content = message["role"], message.get("content")
    if content is None and (role == "assistant" or message.get("tool_calls")):
        content = ""
    if isinstance(content, list):
        content = parse_content_parts(content, f"{param}.content")  # text, or text and image parts
    if not isinstance(content, (str, list)):
        raise APIError(400, f"{param}.content must be a string or a list of text and image_url parts", param=param)
    parsed: dict[str, Any] = {"role": role, "content": content}
    for name in ("name", "tool_call_id"):
        if (value := message.get(name)) is not None:
            if not isinstance(value, str):
                raise APIError(400, f"{param}.{name} must be a string", param=param)
            parsed[name] = value
    if message.get("tool_calls") is not None:
        if role != "assistant":
            raise APIError(400, f"{param}: only assistant messages carry tool_calls", param=param)
        parsed["tool_calls"] = _parse_tool_calls(message["tool_calls"], param)
    return parsed


def parse_content_parts(parts: list[Any], param: str) -> str | list[dict[str, Any]]:
    """Text parts joined into one string; with image_url parts, the parts as a chat template takes them: text
    parts, and ``{"type": "image"}`` parts keeping their URL and field name for the gateway's image reader
    (service/images.py). An image_url is ``{"url", "detail"}`` or, as some clients send it, the URL alone."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise APIError(400, f"{where}.image_url.url must be a string", param=f"{where}.image_url")
            if isinstance(image, dict) and image.get("detail") not in (None, *IMAGE_DETAILS):
                raise APIError(400, f"{where}.image_url.detail must be one of {', '.join(IMAGE_DETAILS)}",
                               param=f"{where}.image_url.detail")
            out.append({"type": "image", "url": url, "param": f"{where}.image_url"})
        else:
            raise APIError(400, f"{where}: only text and image_url parts are supported", param=where)
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def message_text_chars(content: str | list[dict[str, Any]]) -> int:
    """The characters of a parsed message's text (its image parts count none: their tokens are bounded apart)."""
    return len(content) if isinstance(content, str) else sum(len(p.get("text", "")) for p in content)


def _parse_tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise APIError(400, f"{param}.tool_calls must be a list", param=param)
    return [_parse_tool_call(call, f"{param}.tool_calls[{j}]", param) for j, call in enumerate(calls)]


def _parse_tool_call(call: Any, where: str, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise APIError(400, f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                       param=param)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI sends JSON text; the Qwen and Llama templates iterate a dict
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise APIError(400, f"{where}.function.arguments is not valid JSON", param=param) from None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object", param=param)
    parsed = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        parsed["id"] = call["id"]
    return parsed


def _parse_template_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise APIError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    if reserved := sorted(_TEMPLATE_ARGS & kwargs.keys()):
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    return kwargs


def parse_prompts(value: Any, param: str, most: int) -> list[str | list[int]]:
    """A prompt (text or token ids), or a list of them (at most ``most``): one engine request each."""
    batch = value if isinstance(value, list) and value and isinstance(value[0], (str, list)) else [value]
    if len(batch) > most:
        raise APIError(400, f"'{param}' lists {len(batch)} prompts, this server takes at most {most} per request",
                       param=param)
    prompts = [_prompt(p) for p in batch]
    if not all(prompts):
        raise APIError(400, f"'{param}' must be a non-empty string, a non-empty list of token ids, or a list of "
                            "those", param=param)
    return prompts


def _prompt(prompt: Any) -> str | list[int] | None:
    """A non-empty text or a non-empty list of token ids; None (or empty) for anything else."""
    return prompt if isinstance(prompt, str) else _token_ids(prompt)


def _integer(value: Any) -> int | None:
    """An integer as JSON Schema reads one: 2, or 2.0 (never a boolean); None for anything else."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _token_ids(value: Any) -> list[int] | None:
    """A list of integers (2.0 read as 2); None for anything else."""
    ids = [_integer(t) for t in value] if isinstance(value, list) else None
    return None if ids is None or None in ids else ids


def _parse_structured_output(body: dict[str, Any],
                             tools: ToolRequest | None) -> tuple[StructuredOutputParams | None, str | None]:
    """The one structured output the body asks for (with the field it came from), or a forced tool call's."""
    given = [name for name in SO_SOURCES if body.get(name) is not None]
    if len(given) > 1:
        raise APIError(400, f"give at most one of {', '.join(given)}", param=given[1])
    so = tools.structured_output() if tools is not None else None
    if not given:
        return so, "tool_choice" if so is not None else None
    name = given[0]
    try:
        own = _SO_READERS[name](body[name])
    except (ValueError, TypeError, KeyError) as exc:
        raise APIError(400, f"{name}: {exc}", param=name) from None
    if own is not None and so is not None:
        raise APIError(400, f"{name} cannot be combined with a forced tool call (tool_choice)", param=name)
    return (own, name) if own is not None else (so, "tool_choice" if so is not None else None)


def _json_text(schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object (or its JSON text)")
    return json.dumps(schema)


def _response_format(fmt: Any) -> StructuredOutputParams | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputParams(json_object=True)
    if kind != "json_schema":
        raise ValueError("type must be 'text', 'json_object' or 'json_schema'")
    spec_ = fmt.get("json_schema")
    if not isinstance(spec_, dict) or not isinstance(spec_.get("name", ""), str):
        raise ValueError("json_schema must be an object {name, schema, strict, description}")
    schema = spec_.get("schema")
    # OpenAI's default for a schema-less json_schema is any JSON object.
    return StructuredOutputParams(json_object=True) if schema is None else StructuredOutputParams(json=_json_text(schema))


def _structured_outputs(value: Any) -> StructuredOutputParams:
    """vLLM's ``structured_outputs`` object: one of json, regex, choice, grammar, json_object."""
    if not isinstance(value, dict):
        raise ValueError("must be an object with one of json, regex, choice, grammar, json_object")
    known = {"json", "regex", "choice", "grammar", "json_object"}
    if unknown := sorted(k for k, v in value.items() if k not in known and v not in (None, False)):
        raise ValueError(f"unsupported keys {', '.join(unknown)}")
    given = {k: v for k, v in value.items() if k in known and v is not None}
    if "json" in given:
        given["json"] = _json_text(given["json"])
    return StructuredOutputParams(**given)


def _typed(kind: type, what: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not isinstance(value, kind):
            raise ValueError(f"must be {what}")
        return value
    return check


_SO_READERS: dict[str, Callable[[Any], StructuredOutputParams | None]] = {
    "response_format": _response_format,
    "guided_json": lambda v: StructuredOutputParams(json=_json_text(v)),
    "guided_regex": lambda v: StructuredOutputParams(regex=_typed(str, "a string")(v)),
    "guided_choice": lambda v: StructuredOutputParams(choice=_typed(list, "a list of strings")(v)),
    "guided_grammar": lambda v: StructuredOutputParams(grammar=_typed(str, "a string")(v)),
    "structured_outputs": _structured_outputs,
}


def _parse_logit_bias(bias: Any, config: GatewayConfig) -> dict[int, float] | None:
    """OpenAI's map of token ids (as strings) to a bias in [-100, 100]; the ids are checked against the
    vocabulary once the tokenizer is at hand."""
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise APIError(400, "logit_bias must be an object mapping token ids to numbers", param="logit_bias")
    _check_cap("logit_bias", len(bias), config.max_logit_bias)
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise APIError(400, f"logit_bias key {key[:20]!r} is not a token id", param="logit_bias")
        if type(value) not in (int, float) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias values must be numbers in [-100, 100], got {str(value)[:20]}",
                           param="logit_bias")
        parsed[int(key)] = float(value)
    return parsed


def _parse_stop(stop: Any, config: GatewayConfig) -> list[str]:
    stops = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    _check_cap("stop", len(stops), config.max_stop_strings)
    if any(len(s) > config.max_stop_string_len for s in stops):
        raise APIError(400, f"stop strings are limited to {config.max_stop_string_len} characters", param="stop")
    return stops


def _parse_stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise APIError(400, "stream_options can only be given when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    return _get(options, "include_usage", bool, False)


def _get(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    """``body[name]`` checked against ``kind`` (ints pass as floats, bools never as numbers)."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise APIError(400, f"'{name}' is out of range", param=name) from None
    if kind is int and (whole := _integer(value)) is not None:
        return whole  # 2.0 too: a schema's integer is a number with no fraction, however it is written
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise APIError(400, f"'{name}' must be of type {kind.__name__}", param=name)
    return value


def _read(body: dict[str, Any], f: Field) -> Any:
    """A SamplingParams field as the body gives it, else its default."""
    return _get(body, f.name, value_type(SamplingParams, f.name), f.default)


def _check_cap(name: str, value: int, cap: int) -> None:
    if value > cap:
        raise APIError(400, f"'{name}' is {value}, this server allows at most {cap}", param=name)


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def require_str(value: Any, param: str) -> str:
    """``value``, a string; else a 400 naming ``param``."""
    if not isinstance(value, str):
        raise APIError(400, "must be a string", param=param)
    return value


def _log_unknown(body: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        log.info("ignoring unknown request fields: %s", ", ".join(unknown[:20]))


def check_context(request: GenerationRequest, num_prompt_tokens: int, max_model_len: int) -> None:
    """Fills in max_tokens and rejects prompt + max_tokens beyond the context (``engine.context_length``'s rule)."""
    params = request.params
    try:
        params.max_tokens = fit_max_tokens(num_prompt_tokens, params.max_tokens, max_model_len,
                                           "messages" if request.chat else "prompt")
    except ContextLengthError as exc:
        raise APIError(400, str(exc), param=exc.param, code="context_length_exceeded") from None
    if params.min_tokens > params.max_tokens:
        raise APIError(400, f"min_tokens ({params.min_tokens}) exceeds the room left for the completion "
                            f"({params.max_tokens} tokens)", param="min_tokens")


def check_input(num_tokens: int, max_model_len: int, param: str) -> None:
    """An embedding input within the context (``engine.context_length``'s rule)."""
    try:
        check_input_length(num_tokens, max_model_len, param)
    except ContextLengthError as exc:
        raise APIError(400, str(exc), param=exc.param, code="context_length_exceeded") from None
