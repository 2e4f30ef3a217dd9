"""Tools, tool_choice, the hermes tool-call parser and the qwen3 reasoning parser through the whole stack,
with the openai SDK. The demo model was never trained on tool calls: a forced call's grammar (or a guided_regex)
makes it a call, and every call is checked against its tool's parameters with jsonschema."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from service.local_stack import LocalStack
from tests.service.conftest import API_KEY, MODEL_NAME, ROOT, START_TIMEOUT_S

MAX_TOKENS = 600  # the noise closes every bounded string / array of the tools below well before it
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "description": "Adds two integers.", "parameters": {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                   "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                   "labels": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{0,4}$"},
                              "maxItems": 2}},
    "required": ["a", "b"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, ADD)]
PARAMETERS = {f["name"]: f["parameters"] for f in (WEATHER, ADD)}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", '
               r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def client(roomy_stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{roomy_stack.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def end_calls(tokenizer) -> dict[str, int]:
    """tool_choice="required" makes a JSON list of calls, and the demo model, never trained on calls, keeps
    adding to it: a logit bias on ']' (which the tools' patterns allow only to close a list) ends it."""
    return {str(tokenizer.convert_tokens_to_ids("]")): 5}


def tool_chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(**{"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS,
                                             "max_tokens": MAX_TOKENS, **kwargs})


def check_calls(calls, names: set[str]) -> None:
    assert calls, "no tool calls"
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id), call
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def streamed_calls(chunks: Iterator) -> tuple[list[dict], str, str | None]:
    """The calls put together from the deltas as a client does (checking that each call's first delta
    carries its id and name, later ones only argument text), the content, and the finish reason."""
    calls: dict[int, dict] = {}
    content, reason = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for part in choice.delta.tool_calls or []:
                if part.index not in calls:
                    assert part.id and part.function.name, part
                    calls[part.index] = {"id": part.id, "name": part.function.name,
                                         "arguments": part.function.arguments or ""}
                else:
                    assert part.id is None and not part.function.name, part
                    calls[part.index]["arguments"] += part.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, reason


def as_dicts(calls) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in calls]


def test_required_tool_choice_makes_valid_calls(client, end_calls) -> None:
    out = tool_chat(client, tool_choice="required", n=3, seed=4, logit_bias=end_calls)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        check_calls(choice.message.tool_calls, set(PARAMETERS))
        assert not choice.message.content
    no_parallel = tool_chat(client, tool_choice="required", parallel_tool_calls=False, n=3, seed=4)
    assert all(len(c.message.tool_calls) == 1 for c in no_parallel.choices)


def test_named_tool_choice(client) -> None:
    out = tool_chat(client, tool_choice={"type": "function", "function": {"name": "add"}}, n=2, seed=7)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"add"})


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_equal_the_whole_response(client, end_calls, choice) -> None:
    whole = tool_chat(client, tool_choice=choice, seed=12, logit_bias=end_calls)
    calls, content, reason = streamed_calls(tool_chat(client, tool_choice=choice, seed=12, stream=True,
                                                      logit_bias=end_calls))
    assert reason == "tool_calls" and not content
    assert [{k: c[k] for k in ("name", "arguments")} for c in calls] == [
        {k: c[k] for k in ("name", "arguments")} for c in as_dicts(whole.choices[0].message.tool_calls)]


def test_auto_tool_choice_parses_a_hermes_call(client) -> None:
    """tool_choice "auto" with the default hermes parser; a guided_regex makes the noise a call."""
    out = tool_chat(client, tool_choice="auto", seed=3, extra_body={"guided_regex": HERMES_CALL})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    check_calls(choice.message.tool_calls, {"get_weather"})
    assert not choice.message.content
    calls, content, reason = streamed_calls(tool_chat(client, tool_choice="auto", seed=3, stream=True,
                                                      extra_body={"guided_regex": HERMES_CALL}))
    assert reason == "tool_calls" and not content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    # noise without the grammar is content, not a call
    plain = tool_chat(client, tool_choice="auto", seed=3, max_tokens=20, extra_body={"ignore_eos": True})
    assert plain.choices[0].message.tool_calls in (None, []) and plain.choices[0].message.content


def conversation() -> list[dict]:
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    return [*MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees, light rain"}]


def test_conversation_with_a_tool_result_is_accepted(client) -> None:
    out = tool_chat(client, messages=conversation(), tool_choice={"type": "function", "function": {"name": "add"}},
                    seed=2)
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(out.choices[0].message.tool_calls, {"add"})
    answer = client.chat.completions.create(model=MODEL_NAME, messages=conversation(), tools=TOOLS, max_tokens=5,
                                            extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens > 0


def post(client: openai.OpenAI, path: str, body: dict) -> dict:
    return client.post(path, body=body, cast_to=object)


def test_tokenize_renders_the_tools_and_the_conversation(roomy_stack, tokenizer) -> None:
    base = openai.OpenAI(base_url=roomy_stack.url, api_key=API_KEY, max_retries=0)
    body = post(base, "/tokenize", {"model": MODEL_NAME, "messages": conversation(), "tools": TOOLS})
    text = tokenizer.decode(body["tokens"])
    expected = tokenizer.apply_chat_template(conversation(), tools=TOOLS, add_generation_prompt=True,
                                             tokenize=False)
    assert text == expected
    assert body["count"] == len(body["tokens"])
    for needle in ("<tools>", '"get_weather"', '"add"', "The weather in a city.", "<tool_call>",
                   "<tool_response>\n18 degrees, light rain\n</tool_response>"):
        assert needle in text, needle
    # tool_choice "none": the template gets no tools
    none = post(base, "/tokenize", {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})
    assert "<tools>" not in tokenizer.decode(none["tokens"])
    round_trip = post(base, "/detokenize", {"model": MODEL_NAME, "tokens": body["tokens"]})
    assert round_trip["prompt"] == text


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!", "parameters": {}}}]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_a_400(client, extra: dict, param: str) -> None:
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, extra_body=body)
    assert exc.value.status_code == 400
    assert exc.value.param is not None and exc.value.param.startswith(param), exc.value.body


# ---- reasoning: one more gateway, with --reasoning-parser qwen3, on the stack's Redis and workers ----------
THOUGHT = r"[a-z ]{1,30}"
ANSWER = r"[a-z]{1,12}"
THINKING = rf"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"


@pytest.fixture(scope="module")
def reasoning_client(roomy_stack: LocalStack, demo_model: str) -> Iterator[openai.OpenAI]:
    extra = LocalStack(env={"PAGEDSERVE_API_KEY": API_KEY}, cwd=ROOT)
    extra.add_gateway(["--model", demo_model, "--served-model-name", MODEL_NAME, "--log-level", "WARNING",
                       "--reasoning-parser", "qwen3"], redis_url=roomy_stack.redis_url)
    with extra:
        extra.wait_ready(START_TIMEOUT_S)
        yield openai.OpenAI(base_url=f"{extra.url}/v1", api_key=API_KEY, max_retries=0)


def test_qwen3_reasoning_is_split_from_the_answer(reasoning_client) -> None:
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 200, "seed": 5,
              "extra_body": {"guided_regex": THINKING}}
    out = reasoning_client.chat.completions.create(n=2, **kwargs)
    for choice in out.choices:
        reasoning = choice.message.model_extra.get("reasoning_content")
        assert choice.finish_reason == "stop"
        assert reasoning is not None and re.fullmatch(THOUGHT, reasoning.strip("\n")), choice.message
        assert re.fullmatch(ANSWER, choice.message.content), choice.message
    reasoning, content = "", ""
    for chunk in reasoning_client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            if c.index == 0:
                reasoning += c.delta.model_extra.get("reasoning_content") or ""
                content += c.delta.content or ""
    first = out.choices[0].message
    assert (reasoning, content) == (first.model_extra["reasoning_content"], first.content)


def test_enable_thinking_false_has_no_reasoning(reasoning_client, roomy_stack, tokenizer) -> None:
    out = reasoning_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=50, seed=5,
        extra_body={"guided_regex": ANSWER, "chat_template_kwargs": {"enable_thinking": False}})
    message = out.choices[0].message
    assert message.model_extra.get("reasoning_content") is None and re.fullmatch(ANSWER, message.content)
    base = openai.OpenAI(base_url=roomy_stack.url, api_key=API_KEY, max_retries=0)
    body = post(base, "/tokenize", {"model": MODEL_NAME, "messages": MESSAGES,
                                    "chat_template_kwargs": {"enable_thinking": False}})
    assert tokenizer.decode(body["tokens"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
