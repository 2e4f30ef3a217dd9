"""OpenAI's Responses API (``POST /v1/responses``) as a thin layer over the chat path: a Responses body becomes a
chat body (the one tokenizer, template, grammar and tool-parser pipeline) and the chat answer, whole or streamed,
becomes a Response with its output items (reasoning, message, function calls), or the Responses event sequence.
Responses are stored (``store``, the default) for ``previous_response_id`` and ``GET /v1/responses/{id}``
(``service.response_store``). ``input_image`` parts become chat image_url parts (service/images.py reads them).
What it does not take is a 400 that names the field: files, built-in tools, background mode."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from service.errors import APIError
from service.protocol import require_str

# The fields taken; of them reasoning, metadata, user, include, truncation, service_tier, prompt_cache_key,
# safety_identifier, stream_options and store are accepted without effect (the prefix cache is automatic).
_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
           "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id", "background",
           "reasoning", "metadata", "user", "include", "truncation", "service_tier", "prompt_cache_key",
           "safety_identifier", "stream_options", "max_tool_calls"}
TEXT_PARTS = ("input_text", "output_text", "text")


def to_chat_body(body: dict[str, Any], previous: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat body of a Responses body (the chat parser checks the sampling fields' values); ``previous``: the
    conversation of the response ``previous_response_id`` names (its instructions are not carried over)."""
    _check_fields(body)
    chat: dict[str, Any] = {"messages": _instructions(body.get("instructions")) + (previous or [])
                            + _input(body.get("input"))}
    for ours, theirs in (("model", "model"), ("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("stream", "stream"), ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("text") is not None:
        chat.update(_text_format(body["text"]))
    return chat


def _check_fields(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise APIError(400, f"unsupported field(s): {', '.join(unknown)}", param=unknown[0])
    if body.get("background"):
        raise APIError(400, "background responses are not supported by this server", param="background")
    if body.get("max_tool_calls") is not None:
        raise APIError(400, "max_tool_calls is not supported by this server", param="max_tool_calls")


def _instructions(instructions: Any) -> list[dict[str, Any]]:
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise APIError(400, "instructions must be a string", param="instructions")
    return [{"role": "system", "content": instructions}]


def _input(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(400, "each input item must be an object", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": _role(item, i), "content": _content(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            _add_call(messages, item, i)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": require_str(item.get("call_id"), f"input[{i}].call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind != "reasoning":  # earlier turns' reasoning is not sent back to the model
            raise APIError(400, f"unsupported input item type {kind!r}", param=f"input[{i}].type")
    return messages


def _role(item: dict[str, Any], i: int) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise APIError(400, "role must be user, assistant, system or developer", param=f"input[{i}].role")
    return "system" if role == "developer" else role


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """The text, or with ``input_image`` parts (an image_url string: a data URL) chat completions' parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of text and input_image parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            url = require_str(part.get("image_url"), f"{where}[{j}].image_url")
            detail = {"detail": part["detail"]} if part.get("detail") is not None else {}
            parts.append({"type": "image_url", "image_url": {"url": url, **detail}})  # the chat parser checks it
        elif kind in TEXT_PARTS:
            parts.append({"type": "text", "text": require_str(part.get("text"), f"{where}[{j}].text")})
        else:
            raise APIError(400, f"unsupported content part type {kind!r} (text and input_image parts are)",
                           param=f"{where}[{j}].type")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], i: int) -> None:
    """A function call of an earlier turn: joins the assistant message before it (parallel calls are one turn)."""
    call = {"id": require_str(item.get("call_id"), f"input[{i}].call_id"), "type": "function",
            "function": {"name": require_str(item.get("name"), f"input[{i}].name"),
                         "arguments": require_str(item.get("arguments"), f"input[{i}].arguments")}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", param="tools")
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, "only function tools are supported", param=f"tools[{i}].type")
        function = {"name": require_str(tool.get("name"), f"tools[{i}].name"),
                    "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description") is not None:
            function["description"] = require_str(tool["description"], f"tools[{i}].description")
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": require_str(choice.get("name"), "tool_choice.name")}}
    raise APIError(400, "tool_choice must be auto, none, required or {type: function, name}", param="tool_choice")


def _text_format(text: Any) -> dict[str, Any]:
    form = text.get("format") if isinstance(text, dict) else None
    kind = form.get("type") if isinstance(form, dict) else None
    if form is None or kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema" and isinstance(form.get("schema"), dict):
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": form.get("name", "output"), "schema": form["schema"], "strict": bool(form.get("strict"))}}}
    raise APIError(400, "text.format must be text, json_object or {type: json_schema, name, schema}",
                   param="text.format")


# ---- answers -------------------------------------------------------------------------------------------------
def response_id(request_id: str) -> str:
    return "resp_" + request_id.removeprefix("chatcmpl-")


@dataclass(slots=True)
class Envelope:
    """What a Response says of its request, the same on every event and the final object."""

    request_id: str
    model: str
    body: dict[str, Any]
    created_at: int

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": response_id(self.request_id), "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": incomplete, "instructions": body.get("instructions"),
                "max_output_tokens": body.get("max_output_tokens"),
                "previous_response_id": body.get("previous_response_id"),
                "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                "text": body.get("text") or {"format": {"type": "text"}}, "store": body.get("store", True) is not False,
                "background": False,
                "metadata": body.get("metadata") or {}}


def conversation(chat: dict[str, Any], body: dict[str, Any], response: dict[str, Any]) -> list[dict[str, Any]]:
    """What a later ``previous_response_id`` continues: the chat messages of this request's conversation (its
    instructions left out) and its output as the assistant's turn (reasoning left out, as for any earlier turn)."""
    history = chat["messages"][1:] if body.get("instructions") is not None else chat["messages"]
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                     "arguments": item["arguments"]}}
             for item in response["output"] if item["type"] == "function_call"]
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    return history + [turn | ({"tool_calls": calls} if calls else {})]


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def from_chat_body(chat: dict[str, Any], envelope: Envelope) -> dict[str, Any]:
    """A whole chat completion as a Response."""
    choice = chat["choices"][0]
    message, rid = choice["message"], envelope.request_id
    output = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(rid, len(output), message["reasoning_content"]))
    if message.get("content"):
        output.append(message_item(rid, len(output), message["content"]))
    for call in message.get("tool_calls") or ():
        output.append(call_item(rid, len(output), call["id"], call["function"]["name"], call["function"]["arguments"]))
    return envelope.response(status_of(choice["finish_reason"]), output, usage(chat["usage"]))


def _item_id(prefix: str, request_id: str, index: int) -> str:
    return f"{prefix}_{request_id.removeprefix('chatcmpl-')}_{index}"


def reasoning_item(request_id: str, index: int, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _item_id("rs", request_id, index), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(request_id: str, index: int, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": _item_id("msg", request_id, index), "status": status, "role": "assistant",
            "content": content}


def call_item(request_id: str, index: int, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": _item_id("fc", request_id, index), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


@dataclass(slots=True)
class _Item:
    kind: str  # "reasoning", "message" or a tool call's stream index ("call 0")
    text: str = ""
    call_id: str = ""
    name: str = ""
    closed: bool = False


@dataclass(slots=True)
class ResponseStream:
    """Chat chunks (one choice) in, the Responses event sequence out, numbered: ``response.created``, then per
    output item ``response.output_item.added``, its deltas and ``…done`` events, ``response.output_item.done``,
    and last ``response.completed`` (``response.incomplete`` at max_output_tokens) with the whole Response."""

    envelope: Envelope
    _items: list[_Item] = field(default_factory=list)
    _sequence: int = 0
    _finish: str | None = None

    def start(self) -> Iterator[tuple[str, dict[str, Any]]]:
        yield self._event("response.created", response=self.envelope.response("in_progress", [], None))
        yield self._event("response.in_progress", response=self.envelope.response("in_progress", [], None))

    def feed(self, chunk: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield from self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                yield from self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                yield from self._call(call)
            self._finish = choice.get("finish_reason") or self._finish

    def end(self, chat_usage: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        yield from self._close()
        status = status_of(self._finish)
        final = self.envelope.response(status, [self._done_item(i) for i in range(len(self._items))],
                                       usage(chat_usage))
        yield self._event("response.completed" if status == "completed" else "response.incomplete", response=final)

    def _text(self, kind: str, text: str) -> Iterator[tuple[str, dict[str, Any]]]:
        if not self._items or self._items[-1].kind != kind or self._items[-1].closed:
            yield from self._close()
            yield from self._open(_Item(kind))
        item, index = self._items[-1], len(self._items) - 1
        item.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        yield self._event(name, item_id=self._id(index), output_index=index, content_index=0, delta=text, **extra)

    def _call(self, call: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        kind = f"call {call.get('index', 0)}"
        if not self._items or self._items[-1].kind != kind or self._items[-1].closed:
            yield from self._close()
            yield from self._open(_Item(kind, call_id=call.get("id", ""), name=call["function"].get("name", "")))
        item, index = self._items[-1], len(self._items) - 1
        arguments = call.get("function", {}).get("arguments") or ""
        if arguments:
            item.text += arguments
            yield self._event("response.function_call_arguments.delta", item_id=self._id(index), output_index=index,
                              delta=arguments)

    def _open(self, item: _Item) -> Iterator[tuple[str, dict[str, Any]]]:
        self._items.append(item)
        index = len(self._items) - 1
        yield self._event("response.output_item.added", output_index=index, item=self._pending_item(index))
        if item.kind == "message":
            yield self._event("response.content_part.added", item_id=self._id(index), output_index=index,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})

    def _close(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """The ``…done`` events of the item being streamed (each item is closed once, when the next opens)."""
        if not self._items or self._items[-1].closed:
            return
        item, index = self._items[-1], len(self._items) - 1
        item.closed = True
        ids = {"item_id": self._id(index), "output_index": index}
        if item.kind == "message":
            yield self._event("response.output_text.done", **ids, content_index=0, text=item.text, logprobs=[])
            yield self._event("response.content_part.done", **ids, content_index=0,
                              part={"type": "output_text", "text": item.text, "annotations": []})
        elif item.kind == "reasoning":
            yield self._event("response.reasoning_text.done", **ids, content_index=0, text=item.text)
        else:
            yield self._event("response.function_call_arguments.done", **ids, arguments=item.text, name=item.name)
        yield self._event("response.output_item.done", output_index=index, item=self._done_item(index))

    def _id(self, index: int) -> str:
        return self._done_item(index)["id"]

    def _pending_item(self, index: int) -> dict[str, Any]:
        item, rid = self._items[index], self.envelope.request_id
        if item.kind == "message":
            return message_item(rid, index, "", status="in_progress")
        if item.kind == "reasoning":
            return reasoning_item(rid, index, "") | {"content": [], "status": "in_progress"}
        return call_item(rid, index, item.call_id, item.name, "", status="in_progress")

    def _done_item(self, index: int) -> dict[str, Any]:
        item, rid = self._items[index], self.envelope.request_id
        if item.kind == "message":
            return message_item(rid, index, item.text)
        if item.kind == "reasoning":
            return reasoning_item(rid, index, item.text)
        return call_item(rid, index, item.call_id, item.name, item.text)

    def error(self, code: str | None, message: str, param: str | None) -> tuple[str, dict[str, Any]]:
        """The ``error`` event of a stream that fails after its start, numbered after the events sent."""
        return self._event("error", code=code, message=message, param=param)

    def _event(self, kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        self._sequence += 1
        return kind, {"type": kind, "sequence_number": self._sequence - 1, **fields}
