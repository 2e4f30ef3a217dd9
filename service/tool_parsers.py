"""Tool calls found in a model's text, by the format its chat template teaches it.

A parser's ``split(text, start, final)`` cuts what it can already decide of ``text`` into pieces (content
strings and ``ToolCall``s) and says how many characters those took; the rest waits for more text. Only
``ToolCallStream`` drives it, both for streaming and for the whole text at once (``extract``), so a
streamed response and a non-streamed one cannot disagree. A call whose JSON is bad, or whose tag never
closes, stays plain content.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Protocol

from service.harmony import HarmonyReader, Piece

_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolParser(Protocol):
    def split(self, text: str, start: bool, final: bool) -> tuple[list[Any], int]: ...


def _call(obj: Any, args_key: str) -> ToolCall | None:
    """{"name": ..., args_key: {...}} as a call; None when it is not that shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, {})
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _named_call(name: str, arguments: str) -> ToolCall | None:
    """A call of ``name`` whose arguments are the JSON object ``arguments``; None when they are not one."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    return _call({"name": name, "arguments": args}, "arguments") if name else None


def _json_calls(text: str, args_key: str, separator: str = "") -> list[ToolCall] | None:
    """Every JSON object (or list of them) in ``text``, separated by ``separator``; None unless all are calls."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        try:
            obj, i = decoder.raw_decode(text, _skip_space(text, i))
        except ValueError:
            return None
        found = [_call(o, args_key) for o in (obj if isinstance(obj, list) else [obj])]
        if not found or None in found:
            return None
        calls += found
        i = _skip_space(text, i)
        if i == len(text):
            return calls
        if not separator or not text.startswith(separator, i):
            return None
        i += len(separator)


def _skip_space(text: str, i: int) -> int:
    return len(text) - len(text[i:].lstrip())


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that could be the start of ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


def _tagged_calls(text: str, final: bool, open_tag: str, close_tag: str,
                  parse: Callable[[str], ToolCall | None]) -> tuple[list[Any], int]:
    """``split`` for calls each between ``open_tag`` and ``close_tag``, content around them: ``parse`` reads a
    call's inside (None: not a call, and the tagged text stays content)."""
    pieces: list[Any] = []
    i = 0
    while (begin := text.find(open_tag, i)) >= 0:
        pieces.append(text[i:begin])
        end = text.find(close_tag, begin)
        if end < 0:  # still open: the call waits for its end, or is content if it never comes
            return (pieces + [text[begin:]], len(text)) if final else (pieces, begin)
        i = end + len(close_tag)
        call = parse(text[begin + len(open_tag):end])
        pieces.append(call if call is not None else text[begin:i])
    held = 0 if final else _partial_tag(text[i:], open_tag)
    return pieces + [text[i:len(text) - held]], len(text) - held


class HermesParser:
    """Qwen2.5 / Qwen3 / Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any
    number of them, with content around."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def split(self, text: str, start: bool, final: bool) -> tuple[list[Any], int]:
        return _tagged_calls(text, final, self.OPEN, self.CLOSE, self._call)

    @staticmethod
    def _call(inside: str) -> ToolCall | None:
        calls = _json_calls(inside, "arguments")
        return calls[0] if calls and len(calls) == 1 else None


class Qwen3CoderParser:
    """Qwen3-Coder's XML calls: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...
    </function>\\n</tool_call>``. A value is raw text: its type comes from the tool's JSON schema (a string stays
    text; numbers, booleans, objects and arrays are read as JSON, and stay text when they do not parse)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def __init__(self, tools: list[dict[str, Any]] = ()) -> None:
        self._properties = {t["name"]: (t.get("parameters") or {}).get("properties") or {} for t in tools}

    def split(self, text: str, start: bool, final: bool) -> tuple[list[Any], int]:
        return _tagged_calls(text, final, self.OPEN, self.CLOSE, self._call)

    def _call(self, inside: str) -> ToolCall | None:
        function = self._FUNCTION.fullmatch(inside)
        if function is None:
            return None
        name, body = function[1].strip(), function[2]
        properties = self._properties.get(name, {})
        args = {key.strip(): _typed(value, properties.get(key.strip(), {}))
                for key, value in self._PARAMETER.findall(body)}
        if self._PARAMETER.sub("", body).strip():  # text outside the parameters: not this format
            return None
        return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _typed(value: str, schema: dict[str, Any]) -> Any:
    """A parameter's raw text as its schema's type says: text for a string (or a string enum's member), JSON for
    the other types (``True``/``False`` too, as Python spells them); text again where that does not parse."""
    kind = schema.get("type")
    if kind == "string" or value in schema.get("enum", ()):
        return value
    if kind == "boolean" and value.strip() in ("True", "False"):
        return value.strip() == "True"
    try:
        return json.loads(value)
    except ValueError:
        return value


class Llama3JsonParser:
    """Llama 3.1 / 3.2: the whole message is ``{"name": ..., "parameters": {...}}`` (several separated by
    ``;``), maybe after ``<|python_tag|>``; anything else is content."""

    TAG = "<|python_tag|>"

    def split(self, text: str, start: bool, final: bool) -> tuple[list[Any], int]:
        head = text.lstrip()
        if not (start and (head.startswith(("{", self.TAG)) or self.TAG.startswith(head))):
            return [text], len(text)
        if not final:  # JSON until proven otherwise: only the end says whether it parses
            return [], 0
        body = head.removeprefix(self.TAG)
        calls = _json_calls(body, "parameters", ";") or _json_calls(body, "arguments", ";")
        return (calls or [text]), len(text)


class PythonicParser:
    """Llama 3.2 / Llama 4's pythonic calls: the whole message is a Python list of calls with keyword arguments,
    ``[get_weather(city="Paris"), get_time()]``, maybe between ``<|python_start|>`` and ``<|python_end|>``
    (Llama 4); values are Python literals (``True``, ``None``, nested lists and dicts). Anything else, or a
    positional argument, is content."""

    START, END = "<|python_start|>", "<|python_end|>"

    def split(self, text: str, start: bool, final: bool) -> tuple[list[Any], int]:
        head = text.lstrip()
        if not (start and (head.startswith(("[", self.START)) or self.START.startswith(head))):
            return [text], len(text)
        if not final:  # a call list until proven otherwise: only the end says whether it parses
            return [], 0
        calls = self._calls(head.removeprefix(self.START).strip().removesuffix(self.END))
        return (calls or [text]), len(text)

    @staticmethod
    def _calls(body: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            return [_pythonic_call(node) for node in tree.elts]
        except (SyntaxError, ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
            return None


def _pythonic_call(node: ast.expr) -> ToolCall:
    """``name(key=literal, ...)`` as a call; ValueError for anything else."""
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        raise ValueError("not a call with keyword arguments only")
    name = ast.unparse(node.func)  # a dotted name stays whole (``brave_search.call``)
    if not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"not a function name: {name}")
    args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


class MistralParser:
    """Mistral: content, then ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or (newer
    templates) ``[TOOL_CALLS]name[ARGS]{...}`` repeated, up to the end."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def split(self, text: str, start: bool, final: bool) -> tuple[list[Any], int]:
        begin = text.find(self.TAG)
        if begin < 0:
            held = 0 if final else _partial_tag(text, self.TAG)
            return [text[:len(text) - held]], len(text) - held
        if not final:
            return [text[:begin]], begin
        calls = self._calls(text[begin:])
        return [text[:begin], *(calls or [text[begin:]])], len(text)

    def _calls(self, text: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for part in text.split(self.TAG)[1:]:
            name, sep, args = part.partition(self.ARGS)
            found = [_named_call(name.strip(), args)] if sep else _json_calls(part, "arguments")
            if not found or None in found:
                return None
            calls += found
        return calls


@dataclass(slots=True)
class CallHead:
    """A call's start, its name known: the stream's next tool call opens with it."""

    name: str


@dataclass(slots=True)
class CallArguments:
    """More of the open call's arguments (JSON text as generated)."""

    text: str


# A "required" call's start up to its arguments (after the previous call's closing brace, if any).
_REQUIRED_HEAD = re.compile(r'\s*\}?\s*[\[,]?\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"parameters"\s*:\s*')


class ForcedCallParser:
    """The output of a forced call (tool_choice "required" or a named function): the grammar's JSON, whatever
    the model's own format, streamed as it comes. A named function's output is its arguments; "required"'s
    is a list of {"name", "parameters"} in that key order (the schema's, which the grammar keeps), so each
    call opens once its name is read and its arguments stream until their object closes. A call cut short
    (max_tokens) keeps what it got, as OpenAI's are."""

    def __init__(self, name: str | None) -> None:
        self.name = name  # the named function's; None: a list of {"name", "parameters"}
        self._in_call = False  # a call's head was given and its arguments have not closed
        self._depth = 0  # nesting inside the open arguments
        self._string = self._escape = False

    def split(self, text: str, start: bool, final: bool) -> tuple[list[Any], int]:
        if self.name is not None:
            pieces = [] if self._in_call else [CallHead(self.name)]
            self._in_call = True
            return pieces + ([CallArguments(text)] if text else []), len(text)
        pieces, used = [], 0
        while used < len(text):
            if not self._in_call:
                head = _REQUIRED_HEAD.match(text, used)
                if head is None:  # the list's end, or a head not complete yet
                    return pieces, len(text) if final else used
                pieces.append(CallHead(head.group(1)))
                used, self._in_call = head.end(), True
            if self._depth == 0:  # the space before the arguments' opening brace is not theirs
                used = _skip_space(text, used)
            taken = self._arguments(text, used)
            pieces += [CallArguments(text[used:taken])] if taken > used else []
            used = taken
        return pieces, used

    def _arguments(self, text: str, i: int) -> int:
        """Where the open arguments end in ``text`` (after their closing character), or ``len(text)``."""
        for j in range(i, len(text)):
            ch = text[j]
            if self._string:
                self._escape, self._string = not self._escape and ch == "\\", self._escape or ch != '"'
            elif ch == '"':
                self._string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._in_call = False
                    return j + 1
        return len(text)


class HarmonyParser:
    """gpt-oss's harmony messages (service/harmony.py): one to ``functions.NAME`` is a call of NAME with its body
    as the arguments, read whole (bad JSON leaves the message, as written, content); the others' bodies, and text
    outside messages, are content."""

    def __init__(self) -> None:
        self._reader = HarmonyReader()
        self._arguments: list[str] = []  # the open call's body so far

    def split(self, text: str, start: bool, final: bool) -> tuple[list[Any], int]:
        pieces, used = self._reader.read(text, final)
        return [out for p in pieces if (out := self._piece(p))], used

    def _piece(self, piece: Piece) -> ToolCall | str:
        name = piece.header.function if piece.header else None
        if name is None:
            return piece.text if piece.part in ("outside", "body") else ""
        if piece.part != "close":
            self._arguments += [piece.text] if piece.part == "body" else []
            return ""
        arguments, self._arguments = "".join(self._arguments), []
        return _named_call(name, arguments) or piece.header.raw + arguments + piece.text


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
                             "pythonic": PythonicParser, "qwen3_coder": Qwen3CoderParser, "gpt_oss": HarmonyParser}


def make_parser(name: str, tools: list[dict[str, Any]]) -> ToolParser:
    """The parser ``name`` (``--tool-call-parser``); the XML format reads its values' types off ``tools``."""
    return Qwen3CoderParser(tools) if name == "qwen3_coder" else PARSERS[name]()


def call_id(seed: str, index: int) -> str:
    """OpenAI's shape ("call_" + 24 alphanumerics), derived from the request and position: a resumed stream
    replays the same ids."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return "call_" + "".join(_ALPHABET[b % len(_ALPHABET)] for b in digest[:24])


class ToolCallStream:
    """Feeds a parser text deltas; gives OpenAI delta parts: {"content": ...} and, per call, a
    {"tool_calls": [{index, id, type, function: {name, arguments: ""}}]} then its arguments. Whitespace
    next to a call is not content."""

    def __init__(self, parser: ToolParser, seed: str) -> None:
        self.parser, self.seed = parser, seed
        self.num_calls = 0
        self._text = ""  # what the parser has not decided yet
        self._start = True  # nothing decided yet
        self._space = ""  # trailing whitespace of the content: dropped if a call follows
        self._after_call = False

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        self._text += text
        pieces, used = self.parser.split(self._text, self._start, final)
        self._text = self._text[used:]
        self._start = self._start and used == 0
        deltas = [d for p in pieces for d in self._piece(p)]
        if final and self._space and not self.num_calls:
            deltas.append({"content": self._space})
        return deltas

    def _content(self, text: str) -> list[dict[str, Any]]:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        return [{"content": body}] if body else []

    def _piece(self, piece: Any) -> list[dict[str, Any]]:
        if isinstance(piece, ToolCall):
            return self._head(piece.name) + self._arguments(piece.arguments)
        if isinstance(piece, CallHead):
            return self._head(piece.name)
        if isinstance(piece, CallArguments):
            return self._arguments(piece.text)
        return self._content(piece)

    def _head(self, name: str) -> list[dict[str, Any]]:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        self._space, self._after_call = "", True
        return [{"tool_calls": [{"index": index, "id": call_id(self.seed, index), "type": "function",
                                 "function": {"name": name, "arguments": ""}}]}]

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        return [{"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": text}}]}] if text else []


def extract(parser: ToolParser, text: str, seed: str = "") -> tuple[str | None, list[dict[str, Any]]]:
    """The whole text's content (None when empty) and OpenAI tool_calls, from the same stream."""
    message = merge(ToolCallStream(parser, seed).feed(text, final=True))
    return message["content"] or None, message.get("tool_calls", [])


def merge(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Delta parts put together, as a client does: {"content", "reasoning_content"?, "tool_calls"?}."""
    message: dict[str, Any] = {"content": ""}
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        for key in ("content", "reasoning_content"):
            if key in delta:
                message[key] = message.get(key, "") + delta[key]
        for part in delta.get("tool_calls", ()):
            if "id" in part:
                calls.append({"id": part["id"], "type": "function", "function": dict(part["function"])})
            else:
                calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    return message | ({"tool_calls": calls} if calls else {})


class MessageStream:
    """A chat choice's text as OpenAI delta parts: its reasoning ({"reasoning_content"}), then its answer,
    in which the tool parser (when there is one) finds the calls."""

    def __init__(self, tools: ToolCallStream | None, reasoning: Any | None) -> None:
        self.tools, self.reasoning = tools, reasoning  # reasoning: service.reasoning.reasoning_stream's

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning is not None else ("", text)
        deltas = [{"reasoning_content": reasoning}] if reasoning else []
        if self.tools is not None:
            return deltas + self.tools.feed(content, final)
        return deltas + ([{"content": content}] if content else [])
