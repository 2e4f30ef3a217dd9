"""OpenAI request parsing and validation, vLLM's reading of the fields.

Everything a client can get wrong is caught here and raised as ``APIError``
(a 4xx with OpenAI's error body) before anything reaches Redis.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import Field, dataclass, field, fields
from typing import Any

from engine.field_specs import value_type
from engine.sampling_params import SamplingParams

from service.config import GatewayConfig

log = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
                503: "service_unavailable_error"}
ROLES = {"system", "developer", "user", "assistant", "tool"}
_PARAMS = {f.name: f for f in fields(SamplingParams)}
# SamplingParams fields read by hand below (caps, aliases, chat's boolean logprobs); a body sets every
# other one under its own name, with its type and default.
_BY_HAND = {"n", "max_tokens", "logprobs", "stop_token_ids", "early_stopping"}
EARLY_STOPPING = (True, False, "never")  # transformers' values (a bool or a string on the wire)
# Fields that exist in the OpenAI API and are read below; anything else is logged and ignored.
_COMMON = set(_PARAMS) | {"model", "stream", "stream_options", "stop", "include_stop_str_in_output",
                          "skip_special_tokens", "user", "logit_bias", "cache_salt"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                   "tools", "tool_choice", "functions", "response_format"}
_COMPLETION = _COMMON | {"prompt", "echo", "suffix"}
MAX_CACHE_SALT_CHARS = 256
MAX_JSON_DEPTH = 32  # a chat body needs 4 (body, messages, message, content parts)


class APIError(Exception):
    """An error the client sees as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


@dataclass(slots=True)
class GenerationRequest:
    """A validated request; ``params.max_tokens`` is None until the prompt's length is known."""

    chat: bool
    model: str
    params: SamplingParams
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str | list[int] = ""
    add_generation_prompt: bool = True
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    include_usage: bool = False
    want_logprobs: bool = False
    cache_salt: str | None = None


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
    return body


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
    body = _require_object(body)
    _log_unknown(body, _CHAT)
    _reject_unsupported(body)
    for name in ("tools", "functions"):
        if body.get(name):
            raise APIError(400, f"'{name}' is not supported by this server", param=name)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format")
    want = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int, None)
    if top is not None and not want:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    max_tokens = _get(body, "max_completion_tokens", int, None)
    max_tokens = _get(body, "max_tokens", int, None) if max_tokens is None else max_tokens
    request = _parse_common(body, config, chat=True, max_tokens=max_tokens,
                            logprobs=(top or 0) if want else None)
    request.messages = _parse_messages(body.get("messages"))
    request.add_generation_prompt = _get(body, "add_generation_prompt", bool, True)
    return request


def parse_completion(body: Any, config: GatewayConfig) -> GenerationRequest:
    body = _require_object(body)
    _log_unknown(body, _COMPLETION)
    _reject_unsupported(body)
    if _get(body, "echo", bool, False):
        raise APIError(400, "echo is not supported by this server", param="echo")
    if _get(body, "suffix", str, None):
        raise APIError(400, "suffix is not supported by this server", param="suffix")
    request = _parse_common(body, config, chat=False, max_tokens=_read(body, _PARAMS["max_tokens"]),
                            logprobs=_get(body, "logprobs", int, None))
    request.prompt = _parse_prompt(body.get("prompt"))
    return request


def _parse_common(body: dict[str, Any], config: GatewayConfig, chat: bool, max_tokens: int | None,
                  logprobs: int | None) -> GenerationRequest:
    model = _get(body, "model", str, None)
    if model is None:
        raise APIError(400, "'model' is required", param="model")
    n = _read(body, _PARAMS["n"])
    _check_cap("n", n, config.max_n)
    if logprobs is not None:
        _check_cap("top_logprobs" if chat else "logprobs", logprobs, config.max_logprobs)
    best_of = _read(body, _PARAMS["best_of"])
    if best_of is not None:
        _check_cap("best_of", best_of, config.max_n)
    stream = _get(body, "stream", bool, False)
    if stream and _read(body, _PARAMS["use_beam_search"]):
        raise APIError(400, "beam search returns its beams once it is over: it cannot be streamed "
                            "(use_beam_search needs stream=false)", param="use_beam_search")
    return GenerationRequest(
        chat=chat, model=model, stream=stream, params=_sampling_params(body, n, max_tokens, logprobs),
        stop=_parse_stop(body.get("stop"), config),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
        skip_special_tokens=_get(body, "skip_special_tokens", bool, True),
        include_usage=_parse_stream_options(body.get("stream_options"), stream),
        want_logprobs=logprobs is not None, cache_salt=_parse_cache_salt(body))


def _parse_cache_salt(body: dict[str, Any]) -> str | None:
    salt = _get(body, "cache_salt", str, None)
    if salt is not None and len(salt) > MAX_CACHE_SALT_CHARS:
        raise APIError(400, f"cache_salt is limited to {MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
    return salt


def _sampling_params(body: dict[str, Any], n: int, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    stop_ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise APIError(400, "stop_token_ids must be a list of integers", param="stop_token_ids")
    fields_read = {name: _read(body, f) for name, f in _PARAMS.items() if name not in _BY_HAND}
    if fields_read["use_beam_search"] and "temperature" not in body:
        fields_read["temperature"] = 0.0  # beam search scores the raw distribution unless asked otherwise
    try:
        return SamplingParams(n=n, max_tokens=max_tokens, logprobs=logprobs, stop_token_ids=stop_ids,
                              early_stopping=_parse_early_stopping(body), **fields_read)
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


def _parse_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    return [_parse_message(i, m) for i, m in enumerate(messages)]


def _parse_message(i: int, message: Any) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or message["role"] not in ROLES:
        raise APIError(400, f"{param} must be an object with a role in {sorted(ROLES)}", param=param)
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        content = ""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise APIError(400, f"{param}.content: only text parts are supported", param=param)
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(400, f"{param}.content must be a string or a list of text parts", param=param)
    return {"role": message["role"], "content": content}


def _parse_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise APIError(400, "'prompt' must be a non-empty string or list of token ids "
                        "(batches of several prompts are not supported)", param="prompt")


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


def _reject_unsupported(body: dict[str, Any]) -> None:
    if body.get("logit_bias"):
        raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")


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
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise APIError(400, f"'{name}' must be of type {kind.__name__}", param=name)
    return value


def _read(body: dict[str, Any], f: Field) -> Any:
    """A SamplingParams field as the body gives it, else its default."""
    return _get(body, f.name, value_type(SamplingParams, f.name), f.default)


def _check_cap(name: str, value: int, cap: int) -> None:
    if value > cap:
        raise APIError(400, f"'{name}' is {value}, this server allows at most {cap}", param=name)


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _log_unknown(body: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        log.info("ignoring unknown request fields: %s", ", ".join(unknown[:20]))


def check_context(request: GenerationRequest, num_prompt_tokens: int, max_model_len: int) -> None:
    """Fills in max_tokens and rejects prompt + max_tokens beyond the context."""
    params = request.params
    where = "messages" if request.chat else "prompt"
    if num_prompt_tokens >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"{where} has {num_prompt_tokens} tokens, leaving no room for the completion.",
                       param=where, code="context_length_exceeded")
    if params.max_tokens is None:
        params.max_tokens = max_model_len - num_prompt_tokens
    total = num_prompt_tokens + params.max_tokens
    if total > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {total} tokens ({num_prompt_tokens} in the {where}, "
                            f"{params.max_tokens} in the completion). Please reduce the length of the "
                            f"{where} or the completion.", param="max_tokens", code="context_length_exceeded")
    if params.min_tokens > params.max_tokens:
        raise APIError(400, f"min_tokens ({params.min_tokens}) exceeds the room left for the completion "
                            f"({params.max_tokens} tokens)", param="min_tokens")
