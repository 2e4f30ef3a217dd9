"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a thin layer over the chat
path: a Messages body becomes a chat body (the one tokenizer, template, grammar and tool-parser pipeline), and
the chat answer, whole or streamed, becomes a Messages answer; ``image`` blocks become chat image_url parts. What it
does not take is a 400 that names the field: documents, server tools, ``thinking`` budgets (the reasoning parser
decides what is thinking)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from service.errors import APIError
from service.protocol import require_str

# Anthropic's error types, by status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}
# The fields a Messages body may carry; the others (server-side containers, say) are refused: a client would rely
# on them silently. The sampling fields come from clients of older releases of the API.
_FIELDS = {"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k",
           "tools", "tool_choice", "output_config", "thinking"}
# Accepted and without effect here: hints for Anthropic's own service.
_IGNORED = {"metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics", "user_profile_id",
            "workspace_id"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_body(exc: APIError) -> dict[str, Any]:
    """An ``APIError`` in Anthropic's shape."""
    kind = _ERROR_TYPES.get(exc.status, "api_error")
    message = exc.message if exc.param is None else f"{exc.param}: {exc.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def to_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body of a Messages body (the chat parser checks the sampling fields' values)."""
    unknown = sorted(set(body) - _FIELDS - _IGNORED)
    if unknown:
        raise APIError(400, f"unsupported field(s): {', '.join(unknown)}", param=unknown[0])
    if type(body.get("max_tokens")) is not int:
        raise APIError(400, "max_tokens is required (an integer)", param="max_tokens")
    chat = {"messages": _system(body.get("system")) + _messages(body.get("messages"))}
    for ours, theirs in (("model", "model"), ("max_tokens", "max_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("top_k", "top_k"), ("stop", "stop_sequences"), ("stream", "stream")):
        if theirs in body:
            chat[ours] = body[theirs]
    if "tools" in body:
        chat["tools"] = _tools(body["tools"])
    if "tool_choice" in body:
        chat.update(_tool_choice(body["tool_choice"]))
    if "output_config" in body:
        chat.update(_output_format(body["output_config"]))
    return chat


def count_tokens_body(body: dict[str, Any]) -> dict[str, Any]:
    """A ``count_tokens`` body as a /tokenize body of messages (tools count through the template)."""
    chat = to_chat_body({**body, "max_tokens": 1})
    return {key: chat[key] for key in ("model", "messages", "tools") if key in chat}


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    return [{"role": "system", "content": _text(system, "system")}]


def _text(content: Any, where: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(require_str(b.get("text"), f"{where}.text") for b in content)
    raise APIError(400, "must be a string or a list of text blocks", param=where)


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise APIError(400, "each message needs a role of 'user' or 'assistant'", param=f"messages[{i}]")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise APIError(400, "content must be a string or a list of blocks", param=f"messages[{i}].content")
        convert = _assistant if message["role"] == "assistant" else _user
        chat += convert(blocks, f"messages[{i}].content")
    return chat


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Tool results become tool messages (first, as the calls they answer came last), the text and images a user
    message (an image block as chat completions' image_url part)."""
    results, parts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            content = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": require_str(block.get("tool_use_id"), f"{where}[{j}]"),
                            "content": _text(content, f"{where}[{j}].content")})
        elif kind == "text":
            parts.append({"type": "text", "text": require_str(block.get("text"), f"{where}[{j}].text")})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"),
                                                                                f"{where}[{j}].source")}})
        else:
            raise APIError(400, f"unsupported content block type {kind!r} (text, image and tool_result are)",
                           param=f"{where}[{j}].type")
    if not parts and results:
        return results
    text_only = all(p["type"] == "text" for p in parts)
    return results + [{"role": "user", "content": "".join(p["text"] for p in parts) if text_only else parts}]


def _image_url(source: Any, where: str) -> str:
    """An image block's source as a URL: base64 data as a data URL; a url source as it is (the gateway refuses
    http(s) URLs it does not fetch)."""
    if isinstance(source, dict) and source.get("type") == "base64":
        media_type = require_str(source.get("media_type"), f"{where}.media_type")
        return f"data:{media_type};base64,{require_str(source.get('data'), f'{where}.data')}"
    if isinstance(source, dict) and source.get("type") == "url":
        return require_str(source.get("url"), f"{where}.url")
    raise APIError(400, "an image block's source must be {type: base64, media_type, data} or {type: url, url}",
                   param=where)


def _assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Text and tool calls; thinking blocks of earlier turns are dropped (as Anthropic's API drops them)."""
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(require_str(block.get("text"), f"{where}[{j}].text"))
        elif kind == "tool_use":
            if not isinstance(block.get("input"), dict):
                raise APIError(400, "a tool_use block's input must be an object", param=f"{where}[{j}].input")
            calls.append({"id": require_str(block.get("id"), f"{where}[{j}].id"), "type": "function",
                          "function": {"name": require_str(block.get("name"), f"{where}[{j}].name"),
                                       "arguments": json.dumps(block["input"])}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise APIError(400, f"unsupported content block type {kind!r} (text, tool_use and thinking are)",
                           param=f"{where}[{j}].type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    return [message | ({"tool_calls": calls} if calls else {})]


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", param="tools")
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or "input_schema" not in tool or tool.get("type") not in (None, "custom"):
            raise APIError(400, "only custom tools with an input_schema are supported", param=f"tools[{i}]")
        function = {"name": require_str(tool.get("name"), f"tools[{i}].name"), "parameters": tool["input_schema"]}
        if "description" in tool:
            function["description"] = require_str(tool["description"], f"tools[{i}].description")
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": require_str(choice.get("name"), "tool_choice.name")}}
    if mapped is None:
        raise APIError(400, "tool_choice.type must be auto, any, tool or none", param="tool_choice")
    parallel = {"parallel_tool_calls": False} if choice.get("disable_parallel_tool_use") else {}
    return {"tool_choice": mapped} | parallel


def _output_format(config: Any) -> dict[str, Any]:
    """``output_config.format`` (a JSON schema) through the chat path's grammar; ``effort`` has no effect here."""
    if not isinstance(config, dict):
        raise APIError(400, "output_config must be an object", param="output_config")
    form = config.get("format")
    if form is None:
        return {}
    if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise APIError(400, "output_config.format must be {type: json_schema, schema: {...}}",
                       param="output_config.format")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}}


# ---- answers -------------------------------------------------------------------------------------------------
def message_id(request_id: str) -> str:
    return "msg_" + request_id.removeprefix("chatcmpl-")


def from_chat_body(chat: dict[str, Any], matched_stop: str | None) -> dict[str, Any]:
    """A whole chat completion as a Messages answer; ``matched_stop``: the stop sequence that ended it."""
    choice = chat["choices"][0]
    message = choice["message"]
    content = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    content += [_tool_use(call["id"], call["function"]["name"], call["function"]["arguments"])
                for call in message.get("tool_calls") or []]
    reason, sequence = stop_reason(choice["finish_reason"], matched_stop)
    return {"id": message_id(chat["id"]), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(chat["usage"])}


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        arguments_object = json.loads(arguments or "{}")
    except json.JSONDecodeError:  # the model wrote no valid JSON: the raw text, where a client can see it
        arguments_object = {"_raw": arguments}
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments_object}


def stop_reason(finish_reason: str | None, matched_stop: str | None) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence."""
    if matched_stop is not None:
        return "stop_sequence", matched_stop
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


@dataclass(slots=True)
class MessageStream:
    """Chat chunks (one choice) in, Messages stream events out: ``message_start``, then per content block
    ``content_block_start``, its deltas (``thinking_delta``, ``text_delta``, ``input_json_delta``) and
    ``content_block_stop``, then ``message_delta`` (stop_reason, usage) and ``message_stop``."""

    model: str
    _open: str | None = None  # the kind of the block being streamed: "thinking", "text" or a tool call's index
    _index: int = -1
    _finish: str | None = None

    def start(self, request_id: str, prompt_tokens: int) -> Iterator[tuple[str, dict[str, Any]]]:
        yield "message_start", {"type": "message_start", "message": {
            "id": message_id(request_id), "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}

    def feed(self, chunk: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield from self._delta("thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                yield from self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or ():
                yield from self._tool_call(call)
            self._finish = choice.get("finish_reason") or self._finish

    def end(self, matched_stop: str | None, output_tokens: int) -> Iterator[tuple[str, dict[str, Any]]]:
        yield from self._close()
        reason, sequence = stop_reason(self._finish, matched_stop)
        yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                "usage": {"output_tokens": output_tokens}}
        yield "message_stop", {"type": "message_stop"}

    def _delta(self, kind: str, delta: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        if self._open != kind:
            yield from self._close()
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {
                "type": "text", "text": ""}
            yield from self._begin(kind, block)
        yield "content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _tool_call(self, call: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        kind = f"tool {call.get('index', 0)}"
        if self._open != kind:
            yield from self._close()
            block = {"type": "tool_use", "id": call.get("id", ""), "name": call["function"].get("name", ""),
                     "input": {}}
            yield from self._begin(kind, block)
        arguments = call.get("function", {}).get("arguments")
        if arguments:
            yield "content_block_delta", {"type": "content_block_delta", "index": self._index,
                                          "delta": {"type": "input_json_delta", "partial_json": arguments}}

    def _begin(self, kind: str, block: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        self._open, self._index = kind, self._index + 1
        yield "content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block}

    def _close(self) -> Iterator[tuple[str, dict[str, Any]]]:
        if self._open is not None:
            self._open = None
            yield "content_block_stop", {"type": "content_block_stop", "index": self._index}
