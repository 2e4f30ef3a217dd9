"""gpt-oss's harmony format as the model writes it, its special tokens decoded (the gateway keeps them in chat
output when a gpt_oss parser is on): messages ``<|start|>assistant<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>
json]<|message|>BODY`` ended by ``<|end|>``, ``<|return|>`` or ``<|call|>`` (the first one's ``<|start|>assistant``
is the prompt's; the last one's end is a stop token, not in the text). ``analysis`` holds the model's reasoning,
``final`` its answer, and a message to ``functions.NAME`` a tool call, its body the arguments' JSON.

``HarmonyReasoning`` (``--reasoning-parser gpt_oss``) gives the analysis bodies as reasoning, the final ones as
content, and passes any other message on as written for the tool parser (``--tool-call-parser gpt_oss``:
``tool_parsers.HarmonyParser``), which makes the messages to functions tool calls and the others' bodies content.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


@dataclass(slots=True)
class Header:
    """A message's header as written, up to and with its ``<|message|>``."""

    raw: str

    @property
    def channel(self) -> str:
        found = _CHANNEL_NAME.search(self.raw)
        return found[1] if found else ""

    @property
    def function(self) -> str | None:
        """The function the message calls (``to=functions.NAME``); None: not a call."""
        found = _RECIPIENT.search(self.raw)
        return found[1] if found else None


@dataclass(slots=True)
class Piece:
    """Part of the text: outside any message (no header), or a message's header ("open"), body or end token
    ("close"; empty where the output ended inside the body)."""

    header: Header | None
    part: Literal["outside", "open", "body", "close"]
    text: str


def _first(text: str, tokens: tuple[str, ...], i: int) -> tuple[int, str]:
    """The earliest of ``tokens`` in ``text`` from ``i``: (where, which); (-1, "") for none."""
    found = [(at, token) for token in tokens if (at := text.find(token, i)) >= 0]
    return min(found) if found else (-1, "")


def _held(text: str, tokens: tuple[str, ...]) -> int:
    """How much of the end of ``text`` could be the start of one of ``tokens`` (each "<|...", with no other "<")."""
    at = text.rfind("<")
    return len(text) - at if at >= 0 and any(t.startswith(text[at:]) for t in tokens) else 0


@dataclass(slots=True)
class HarmonyReader:
    """Cuts harmony text into pieces as it arrives: a header waits for its ``<|message|>``, a body streams but for
    what could be the start of its end token."""

    open: Header | None = None  # the message whose body is being read

    def read(self, text: str, final: bool) -> tuple[list[Piece], int]:
        """The pieces ``text`` holds for certain, and how many characters they took (the rest waits)."""
        pieces: list[Piece] = []
        i, step = 0, -1
        while i < len(text) and step != i:
            step = i
            i = self._body(text, i, final, pieces) if self.open else self._header(text, i, final, pieces)
        if final and self.open is not None:  # the output ended inside a body
            pieces.append(Piece(self.open, "close", ""))
            self.open = None
        return pieces, i

    def _header(self, text: str, i: int, final: bool, pieces: list[Piece]) -> int:
        begin, _ = _first(text, (START, CHANNEL), i)
        end = text.find(MESSAGE, begin) if begin == i else -1
        if end >= 0:
            self.open = Header(text[begin:end + len(MESSAGE)])
            pieces.append(Piece(self.open, "open", self.open.raw))
            return end + len(MESSAGE)
        if begin == i:  # a header still being written, or cut short (then it is plain text)
            stop = len(text) if final else i
        else:
            stop = begin if begin >= 0 else len(text) - (0 if final else _held(text[i:], (START, CHANNEL)))
        pieces += [Piece(None, "outside", text[i:stop])] if stop > i else []
        return stop

    def _body(self, text: str, i: int, final: bool, pieces: list[Piece]) -> int:
        end, token = _first(text, ENDS, i)
        stop = end if end >= 0 else len(text) - (0 if final else _held(text[i:], ENDS))
        pieces += [Piece(self.open, "body", text[i:stop])] if stop > i else []
        if end < 0:
            return stop
        pieces.append(Piece(self.open, "close", token))
        self.open = None
        return end + len(token)


class HarmonyReasoning:
    """``feed`` gives each delta's (reasoning, content) parts, as ``reasoning.ReasoningStream`` does."""

    def __init__(self) -> None:
        self._reader, self._text = HarmonyReader(), ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._text += text
        pieces, used = self._reader.read(self._text, final)
        self._text = self._text[used:]
        reasoning = "".join(p.text for p in pieces if p.header and p.header.channel == "analysis" and p.part == "body")
        return reasoning, "".join(map(_content, pieces))


def _content(piece: Piece) -> str:
    """What of ``piece`` is content: text outside messages, a final message's body, any other message (but an
    analysis one) whole, for the tool parser."""
    channel = piece.header.channel if piece.header else ""
    if channel == "analysis":
        return ""
    return piece.text if channel != "final" or piece.part == "body" else ""
