"""The reasoning parsers: <think>…</think> split from the answer, whole or in pieces."""
from __future__ import annotations

import random

import pytest

from service.reasoning import ReasoningStream


def _split(parser: str, pieces: list[str], thinking: bool = True) -> tuple[str, str]:
    stream = ReasoningStream(parser, thinking)
    parts = [stream.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


CASES = [  # parser, output, reasoning, content
    ("deepseek_r1", "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "The answer is 4."),
    ("deepseek_r1", "<think>\nHmm 🤔</think>Yes.", "\nHmm 🤔", "Yes."),
    ("deepseek_r1", "Still thinking when cut off", "Still thinking when cut off", ""),
    ("deepseek_r1", "a </thin", "a </thin", ""),
    ("qwen3", "<think>\nplan</think>\n\nHello!", "\nplan", "Hello!"),
    ("qwen3", "No thinking here, 2 < 3.", "", "No thinking here, 2 < 3."),
    ("qwen3", "<think>unfinished", "unfinished", ""),
    ("qwen3", "<thi", "", "<thi"),
    ("qwen3", "<think></think>Answer", "", "Answer"),
]


@pytest.mark.parametrize("parser, text, reasoning, content", CASES)
def test_split(parser: str, text: str, reasoning: str, content: str) -> None:
    assert _split(parser, [text]) == (reasoning, content)
    assert _split(parser, list(text) + [""]) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert _split(parser, [text[:cut], text[cut:]]) == (reasoning, content)
    rng = random.Random(1)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), 3))
        assert _split(parser, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == (reasoning, content)


def test_thinking_disabled_is_all_content() -> None:
    assert _split("qwen3", ["<think>x</think>y"], thinking=False) == ("", "<think>x</think>y")


def test_reasoning_streams_before_the_end() -> None:
    stream = ReasoningStream("deepseek_r1")
    assert stream.feed("step one </th") == ("step one ", "")
    assert stream.feed("ink>ans") == ("", "ans")


def test_unknown_parser() -> None:
    with pytest.raises(ValueError):
        ReasoningStream("nope")
