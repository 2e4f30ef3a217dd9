"""gpt-oss's harmony output through --reasoning-parser gpt_oss and --tool-call-parser gpt_oss, on canned texts: the
whole text at once, one character at a time and in random chunks, all giving the same message."""
from __future__ import annotations

import json
import random

import pytest

from service.config import GatewayConfig
from service.harmony import HarmonyReasoning
from service.protocol import parse_chat, parse_completion
from service.reasoning import reasoning_stream
from service.tool_parsers import HarmonyParser, MessageStream, ToolCallStream, make_parser, merge

A = "<|channel|>analysis<|message|>{0}<|end|>"  # the first message: the prompt wrote its <|start|>assistant
F = "<|start|>assistant<|channel|>final<|message|>{0}"  # its <|return|> is a stop token, not in the text
C = "<|start|>assistant<|channel|>commentary to=functions.{0} <|constrain|>json<|message|>{1}<|call|>"

CASES = [  # text, reasoning, content, calls [(name, arguments)]
    (A.format("User says hi. Reply.") + F.format("Hello! 2 < 3 <| not a token"),
     "User says hi. Reply.", "Hello! 2 < 3 <| not a token", []),
    (A.format("Need weather.") + C.format("get_weather", '{"city": "Zürich"}'),
     "Need weather.", None, [("get_weather", {"city": "Zürich"})]),
    (A.format("Two calls.") + C.format("a", "{}") + C.format("b", '{"x": [1, 2]}'), "Two calls.", None,
     [("a", {}), ("b", {"x": [1, 2]})]),
    (A.format("a") + "<|start|>assistant<|channel|>commentary<|message|>Checking…<|end|>" + C.format("f", "{}"),
     "a", "Checking…", [("f", {})]),  # a preamble to the user, then the call
    (A.format("cut at the stop token") + C.format("f", '{"n": 1}').removesuffix("<|call|>"),
     "cut at the stop token", None, [("f", {"n": 1})]),
    (A.format("bad") + C.format("f", "{oops"), "bad",
     "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops<|call|>", []),
    ("<|channel|>analysis<|message|>cut off while reasoning", "cut off while reasoning", None, []),
    (A.format("x") + "<|start|>assistant<|chan", "x", "<|start|>assistant<|chan", []),  # a header cut short
]


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _message(pieces: list[str]) -> dict:
    stream = MessageStream(ToolCallStream(HarmonyParser(), "s"), HarmonyReasoning())
    return merge([d for k, p in enumerate(pieces) for d in stream.feed(p, final=k == len(pieces) - 1)])


def _chunks(text: str, seed: int) -> list[str]:
    rng, cuts = random.Random(seed), [0]
    while cuts[-1] < len(text):
        cuts.append(cuts[-1] + rng.randint(1, 7))
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_channels_and_calls(text, reasoning, content, calls) -> None:
    whole = _message([text])
    assert whole.get("reasoning_content") == reasoning
    assert (whole["content"] or None) == content
    assert _calls(whole.get("tool_calls", [])) == calls
    assert _message([*text, ""]) == whole
    assert all(_message(_chunks(text, seed)) == whole for seed in range(5))


def test_each_parser_alone() -> None:
    """Without the tool parser, a call stays content as written; without the reasoning parser, the analysis
    body is content (as <think> is without a reasoning parser)."""
    text = CASES[1][0]
    reasoning, content = reasoning_stream("gpt_oss").feed(text, final=True)
    assert (reasoning, content) == ("Need weather.", text.removeprefix(A.format("Need weather.")))
    alone = merge(ToolCallStream(make_parser("gpt_oss", []), "s").feed(text, final=True))
    assert alone["content"] == "Need weather." and _calls(alone["tool_calls"]) == CASES[1][3]


def test_chat_keeps_special_tokens_for_harmony() -> None:
    """The channels are special tokens: a chat request decodes them (unless it asks otherwise) when a gpt_oss
    parser is on; completions and other parsers skip them, as before."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    harmony = GatewayConfig(reasoning_parser="gpt_oss")
    assert not parse_chat(chat, harmony).skip_special_tokens
    assert parse_chat(chat | {"skip_special_tokens": True}, harmony).skip_special_tokens
    assert parse_chat(chat, GatewayConfig()).skip_special_tokens
    assert parse_completion({"prompt": "hi"}, harmony).skip_special_tokens
