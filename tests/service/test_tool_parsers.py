"""Tool-call parsers on canned model texts: whole-text extraction, and streamed deltas (fed one character
at a time and in random chunks) that reassemble to the same message."""
from __future__ import annotations

import json
import random
import re
from functools import partial

import pytest

from service.reasoning import ReasoningStream
from service.tool_parsers import (PARSERS, ForcedCallParser, HermesParser, Llama3JsonParser, MessageStream,
                                  MistralParser, PythonicParser, Qwen3CoderParser, ToolCallStream, call_id, extract,
                                  make_parser, merge)

H = '<tool_call>\n{{"name": "{0}", "arguments": {1}}}\n</tool_call>'
# Qwen3-Coder's XML calls; a value's type comes from its tool's schema.
Q_TOOLS = [{"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "dry": {"type": "boolean"},
    "opts": {"type": "object"}, "tags": {"type": "array"}, "code": {"type": "string"}}}}]
QWEN3_CODER = partial(Qwen3CoderParser, Q_TOOLS)


def q(name: str, **params: str) -> str:
    inside = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{inside}</function>\n</tool_call>"


CASES = [  # parser, text, expected content, expected [(name, arguments)]
    (HermesParser, "Plain answer, no calls.", "Plain answer, no calls.", []),
    (HermesParser, H.format("get_weather", '{"city": "Zürich"}'), None, [("get_weather", {"city": "Zürich"})]),
    (HermesParser, "Let me check.\n" + H.format("a", "{}") + "\n" + H.format("b", '{"x": [1, 2]}'),
     "Let me check.", [("a", {}), ("b", {"x": [1, 2]})]),
    (HermesParser, H.format("a", "{}") + "\nDone 🎉", "Done 🎉", [("a", {})]),
    (HermesParser, "<tool_call>\n{bad json}\n</tool_call>", "<tool_call>\n{bad json}\n</tool_call>", []),
    (HermesParser, "text <tool_call>\n{\"name\": \"a\"", "text <tool_call>\n{\"name\": \"a\"", []),  # unterminated
    (HermesParser, "a < b and <tool", "a < b and <tool", []),
    (HermesParser, '<tool_call>{"name": "a", "arguments": "not an object"}</tool_call>',
     '<tool_call>{"name": "a", "arguments": "not an object"}</tool_call>', []),
    (Llama3JsonParser, '{"name": "search", "parameters": {"q": "日本"}}', None, [("search", {"q": "日本"})]),
    (Llama3JsonParser, '<|python_tag|>{"name": "a", "parameters": {"s": "x;y"}}; {"name": "b", "parameters": {}}',
     None, [("a", {"s": "x;y"}), ("b", {})]),
    (Llama3JsonParser, "Hello {not json", "Hello {not json", []),
    (Llama3JsonParser, '{"name": "a", "parameters": {}} trailing', '{"name": "a", "parameters": {}} trailing', []),
    (Llama3JsonParser, "{oops", "{oops", []),
    (PythonicParser, '[get_weather(city="Zürich", days=3), get_time()]', None,
     [("get_weather", {"city": "Zürich", "days": 3}), ("get_time", {})]),
    (PythonicParser, '<|python_start|>[search(q="日本", opts={"n": [1, 2]}, exact=True, lang=None)]<|python_end|>',
     None, [("search", {"q": "日本", "opts": {"n": [1, 2]}, "exact": True, "lang": None})]),
    (PythonicParser, "[brave_search.call(query='x')]", None, [("brave_search.call", {"query": "x"})]),
    (PythonicParser, "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    (PythonicParser, '[f("positional")]', '[f("positional")]', []),  # keyword arguments only
    (PythonicParser, "[f(x=open('/etc/passwd'))]", "[f(x=open('/etc/passwd'))]", []),  # literals only, never run
    (PythonicParser, "Sure: [f(x=1)]", "Sure: [f(x=1)]", []),  # the whole message, or content
    (PythonicParser, "[f(x=1", "[f(x=1", []),
    (MistralParser, 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"n": 1}}, {"name": "b", "arguments": {}}]',
     "Sure.", [("a", {"n": 1}), ("b", {})]),
    (MistralParser, '[TOOL_CALLS]a[ARGS]{"n": 1}[TOOL_CALLS]b[ARGS]{}', None, [("a", {"n": 1}), ("b", {})]),
    (MistralParser, "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    (MistralParser, "ends with [TOOL", "ends with [TOOL", []),
    (QWEN3_CODER, "I will edit it.\n" + q("edit", path="007.py", line="12", dry="True", opts='{"a": 1}',
                                          tags='["x"]', code="def f():\n    return 1"),
     "I will edit it.", [("edit", {"path": "007.py", "line": 12, "dry": True, "opts": {"a": 1}, "tags": ["x"],
                                   "code": "def f():\n    return 1"})]),
    (QWEN3_CODER, q("edit", line="twelve") + "\n" + q("other", n="3", s="hi"), None,
     [("edit", {"line": "twelve"}), ("other", {"n": 3, "s": "hi"})]),  # no parse: text; no schema: JSON or text
    (QWEN3_CODER, "<tool_call>\n<function=edit>\nstray text\n</function>\n</tool_call>",
     "<tool_call>\n<function=edit>\nstray text\n</function>\n</tool_call>", []),
    (QWEN3_CODER, "<tool_call>\n<function=edit>\n<parameter=path>\na.py", "<tool_call>\n<function=edit>\n"
     "<parameter=path>\na.py", []),  # unterminated
]


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_extract(parser: type, text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = extract(parser(), text, "seed")
    assert got_content == content
    assert _calls(got_calls) == calls
    assert all(re.fullmatch(r"call_[a-zA-Z0-9]{24}", c["id"]) for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


def _streamed(parser: type, pieces: list[str]) -> tuple[list[dict], dict]:
    stream = ToolCallStream(parser(), "seed")
    deltas = [d for k, p in enumerate(pieces) for d in stream.feed(p, final=k == len(pieces) - 1)]
    return deltas, merge(deltas)


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_stream_matches_extract(parser: type, text: str, content: str | None, calls: list) -> None:
    whole = merge(ToolCallStream(parser(), "seed").feed(text, final=True))
    rng = random.Random(0)
    for pieces in [list(text) + [""], *[_chunks(text, rng) + [""] for _ in range(30)]]:
        deltas, message = _streamed(parser, pieces)
        assert message == whole
        for d in deltas:  # a call's head first (with empty arguments), then its arguments
            assert d.keys() <= {"content", "tool_calls"} and all(v for v in d.values())
    for cut in range(len(text) + 1):  # split at every position
        assert _streamed(parser, [text[:cut], text[cut:]])[1] == whole


def test_partial_tag_is_held_back() -> None:
    stream = ToolCallStream(HermesParser(), "s")
    assert stream.feed("Hi <tool_") == [{"content": "Hi"}]  # the space could precede a call: held too
    assert stream.feed("x") == [{"content": " <tool_x"}]


def test_call_head_then_arguments() -> None:
    deltas = ToolCallStream(HermesParser(), "s").feed(H.format("f", '{"a": 1}'), final=True)
    assert deltas == [{"tool_calls": [{"index": 0, "id": call_id("s", 0), "type": "function",
                                       "function": {"name": "f", "arguments": ""}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}]


def test_ids_are_stable_per_seed() -> None:
    assert call_id("r:0", 1) == call_id("r:0", 1) != call_id("r:1", 1)


@pytest.mark.parametrize("name, text, calls", [
    (None, '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]', [("a", {"x": 1}), ("b", {})]),
    (None, '[{"name":"a","parameters":{"s":"}]\\"{","t":[{}]}}]', [("a", {"s": '}]"{', "t": [{}]})]),
    ("f", '{"x": "ü"}', [("f", {"x": "ü"})]),
])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_forced_call_streams_name_first_then_arguments(name: str | None, text: str, calls: list, step: int) -> None:
    content, whole = extract(ForcedCallParser(name), text)
    assert content is None and _calls(whole) == calls
    stream = ToolCallStream(ForcedCallParser(name), "")
    deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i:i + step])]
    deltas += stream.feed("", final=True)
    heads = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [h["function"] for h in heads] == [{"name": n, "arguments": ""} for n, _ in calls]
    assert "id" in deltas[0]["tool_calls"][0]  # the name comes before any argument text
    if step == 1:  # the arguments arrive as they are generated, not at the end
        assert sum("id" not in d["tool_calls"][0] for d in deltas) > len(calls)
    assert merge(deltas)["tool_calls"] == whole  # streamed and whole agree


def test_forced_call_cut_short_keeps_its_partial_arguments() -> None:
    """As OpenAI's: max_tokens ends the call mid-arguments (finish_reason "length"), the call keeps them."""
    (call,) = extract(ForcedCallParser("f"), '{"x": ')[1]
    assert call["function"] == {"name": "f", "arguments": '{"x": '}
    (call,) = extract(ForcedCallParser(None), '[{"name": "g", "parameters": {"y": [1')[1]
    assert call["function"] == {"name": "g", "arguments": '{"y": [1'}
    assert extract(ForcedCallParser(None), '[{"na') == (None, [])


def test_registry() -> None:
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "gpt_oss"}
    assert isinstance(make_parser("hermes", Q_TOOLS), HermesParser)
    # The gateway's parser for a request reads the request's tools: "12" is an integer for edit's line.
    assert _calls(extract(make_parser("qwen3_coder", Q_TOOLS), q("edit", line="12"))[1]) == [("edit", {"line": 12})]


def test_reasoning_then_tool_calls() -> None:
    """Calls are parsed from the answer only: a <tool_call> inside the reasoning is reasoning."""
    text = "<think>maybe <tool_call>{}</tool_call>?</think>\n\nOK.\n" + H.format("f", "{}")
    whole = merge(MessageStream(ToolCallStream(HermesParser(), "s"), ReasoningStream("qwen3")).feed(text, True))
    assert whole["reasoning_content"] == "maybe <tool_call>{}</tool_call>?"
    assert whole["content"] == "OK." and _calls(whole["tool_calls"]) == [("f", {})]
    stream = MessageStream(ToolCallStream(HermesParser(), "s"), ReasoningStream("qwen3"))
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.feed("", final=True)
    assert merge(deltas) == whole
