"""A reasoning model's ``<think>…</think>`` split from its answer, as text deltas arrive.

deepseek_r1: the chat template opens ``<think>`` in the prompt, so the output starts inside the reasoning
(an opening tag it repeats is dropped). qwen3: the output opens it itself; one that does not (e.g. with
enable_thinking=false) has no reasoning. Without a closing tag, everything is reasoning.
"""
from __future__ import annotations

from service.harmony import HarmonyReasoning

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that could be the start of ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ReasoningStream:
    """``feed`` gives each delta's (reasoning, content) parts; text that could be a tag's start waits."""

    def __init__(self, parser: str, enable_thinking: bool = True) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self._state = "open" if enable_thinking else "content"  # open -> reasoning -> answer-start -> content
        self._default = "reasoning" if parser == "deepseek_r1" else "content"  # without an opening tag
        self._text = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._text += text
        reasoning = content = ""
        if self._state == "open":
            head = self._text.lstrip()
            if OPEN.startswith(head) and not final and len(head) < len(OPEN):
                return "", ""
            if head.startswith(OPEN):
                self._text, self._state = head[len(OPEN):], "reasoning"
            else:
                self._state = self._default
        if self._state == "reasoning":
            reasoning = self._reasoning(final)
        if self._state == "answer-start":  # the newlines after </think> are not the answer's
            self._text = self._text.lstrip()
            self._state = "content" if self._text else self._state
        if self._state == "content":
            content, self._text = self._text, ""
        return reasoning, content

    def _reasoning(self, final: bool) -> str:
        end = self._text.find(CLOSE)
        if end >= 0:
            out, self._text, self._state = self._text[:end], self._text[end + len(CLOSE):], "answer-start"
            return out
        keep = 0 if final else _partial(self._text, CLOSE)
        out, self._text = self._text[:len(self._text) - keep], self._text[len(self._text) - keep:]
        return out


def reasoning_stream(parser: str, enable_thinking: bool = True) -> ReasoningStream | HarmonyReasoning:
    """``--reasoning-parser``'s stream: gpt_oss's channels (service/harmony.py; its reasoning is not switched off by
    ``enable_thinking``), or the ``<think>`` tags."""
    return HarmonyReasoning() if parser == "gpt_oss" else ReasoningStream(parser, enable_thinking)
