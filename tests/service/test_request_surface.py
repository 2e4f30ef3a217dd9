"""Issue 27's request fields, no server: structured outputs (response_format, vLLM's guided_* and
structured_outputs), logit_bias, tool messages and chat_template_kwargs, echo and lists of prompts,
prompt_logprobs; each refusal a 400 naming its field. Then the v6 wire and the demo chat template."""
from __future__ import annotations

import json

import msgpack
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.demo_model import CHAT_TEMPLATE
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputParams
from service.config import GatewayConfig
from service.messages import (SCHEMA_VERSION, ChoiceDelta, EventKind, ReplyBatch, ReplyEvent, RequestMsg, decode,
                              decode_batch, encode, encode_batch, params_to_wire)
from service.openapi import openapi_document
from service.protocol import APIError, parse_chat, parse_completion, parse_detokenize, parse_tokenize
from service.tokenization import encode_chat

CONFIG = GatewayConfig()
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def refused(parse, body: dict, param: str) -> APIError:
    with pytest.raises(APIError) as caught:
        parse(body, CONFIG)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    return caught.value


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": SCHEMA, "strict": True}}},
     StructuredOutputParams(json=json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_object"}}, StructuredOutputParams(json_object=True)),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, StructuredOutputParams(json=json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputParams(json=json.dumps(SCHEMA))),
    ({"guided_regex": "[a-z]+"}, StructuredOutputParams(regex="[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputParams(choice=["yes", "no"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputParams(grammar='root ::= "a"')),
    ({"structured_outputs": {"regex": "x+"}}, StructuredOutputParams(regex="x+")),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputParams(json=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputParams(json_object=True)),
])
@pytest.mark.parametrize("parse, base", [(parse_chat, CHAT), (parse_completion, COMPLETION)])
def test_structured_outputs_map_to_one_spec(parse, base: dict, fields: dict, expected) -> None:
    request = parse({**base, **fields}, CONFIG)
    assert request.params.structured_output == expected
    assert request.structured_output_param == (None if expected is None else next(iter(fields)))


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": 3}}, "response_format"),
    ({"guided_json": 5}, "guided_json"), ({"guided_regex": ["a"]}, "guided_regex"),
    ({"guided_choice": "a"}, "guided_choice"), ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
                                                "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"use_beam_search": True, "n": 2, "guided_regex": "a"}, "guided_regex"),
])
def test_bad_structured_outputs_are_400(fields: dict, param: str) -> None:
    refused(parse_chat, {**CHAT, **fields}, param)


def test_logit_bias_is_parsed_and_bounded() -> None:
    params = parse_chat({**CHAT, "logit_bias": {"5": 10, "7": -100}}, CONFIG).params
    assert params.logit_bias == {5: 10.0, 7: -100.0} and not params.argmax_only
    assert parse_chat({**CHAT, "logit_bias": {}}, CONFIG).params.logit_bias is None
    for bias in ({"5": 101}, {"5": -100.5}, {"x": 1}, {"-1": 1}, {"5": "1"}, {"5": True}, [[5, 1]],
                 {str(i): 1 for i in range(CONFIG.max_logit_bias + 1)}):
        refused(parse_chat, {**CHAT, "logit_bias": bias}, "logit_bias")
    refused(parse_completion, {**COMPLETION, "use_beam_search": True, "n": 2, "logit_bias": {"1": 1}}, "logit_bias")


def test_tool_messages_reach_the_template_shape() -> None:
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "name": "get", "content": "sunny"}]
    parsed = parse_chat({**CHAT, "messages": messages}, CONFIG).messages
    assert parsed[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get", "arguments": {"city": "Paris"}}}]}
    assert parsed[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get"}


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
    {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
    {"role": "assistant", "tool_calls": "f()"},
    {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "content": "x", "tool_call_id": 3},
])
def test_bad_tool_messages_are_400(message: dict) -> None:
    refused(parse_chat, {**CHAT, "messages": [{"role": "user", "content": "q"}, message]}, "messages[1]")


def test_chat_template_kwargs() -> None:
    assert parse_chat({**CHAT, "chat_template_kwargs": {"enable_thinking": False}}, CONFIG).chat_template_kwargs == {
        "enable_thinking": False}
    for kwargs in ([1], "x", {"tokenize": True}, {"messages": []}):
        refused(parse_chat, {**CHAT, "chat_template_kwargs": kwargs}, "chat_template_kwargs")


def test_echo_and_lm_eval_scoring_request() -> None:
    # lm-eval 0.4's local-completions loglikelihood request (openai_completions.py, _create_payload)
    body = {"model": "m", "prompt": [[1, 2, 3], [4, 5]], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    request = parse_completion(body, CONFIG)
    assert request.echo and not request.echo_only and request.prompts == [[1, 2, 3], [4, 5]]
    assert request.params.prompt_logprobs == 1 and request.params.logprobs == 1
    scoring = parse_completion({**body, "max_tokens": 0}, CONFIG)  # vLLM's: the prompt's logprobs only
    assert scoring.echo_only and scoring.params.max_tokens == 1
    refused(parse_completion, {**COMPLETION, "max_tokens": 0}, "max_tokens")
    refused(parse_completion, {**COMPLETION, "echo": True, "stream": True}, "echo")
    refused(parse_completion, {**COMPLETION, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs")
    refused(parse_completion, {**COMPLETION, "suffix": "x"}, "suffix")


def test_prompt_logprobs_extra() -> None:
    for parse, base in ((parse_chat, CHAT), (parse_completion, COMPLETION)):
        request = parse({**base, "prompt_logprobs": 3}, CONFIG)
        assert request.prompt_logprobs == 3 and request.params.prompt_logprobs == 3
        refused(parse, {**base, "prompt_logprobs": CONFIG.max_logprobs + 1}, "prompt_logprobs")
    echoed = parse_completion({**COMPLETION, "echo": True, "logprobs": 2, "prompt_logprobs": 4}, CONFIG)
    assert echoed.params.prompt_logprobs == 4 and echoed.prompt_logprobs == 4


@pytest.mark.parametrize("prompt, expected", [
    ("a", ["a"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]), (["a"], ["a"])])
def test_prompt_lists(prompt, expected) -> None:
    assert parse_completion({**COMPLETION, "prompt": prompt}, CONFIG).prompts == expected


@pytest.mark.parametrize("prompt", [[], "", ["a", ""], [[1], []], [["a"]], ["a", [1, True]], [1, "a"],
                                    ["x"] * (CONFIG.max_prompts + 1)])
def test_bad_prompt_lists_are_400(prompt) -> None:
    refused(parse_completion, {**COMPLETION, "prompt": prompt}, "prompt")


def test_tokenize_and_detokenize_bodies() -> None:
    plain = parse_tokenize({"prompt": "hi", "add_special_tokens": False})
    assert plain.prompt == "hi" and not plain.add_special_tokens and plain.messages is None
    chat = parse_tokenize({"model": "m", "messages": [{"role": "user", "content": "x"}],
                           "add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}})
    assert chat.messages == [{"role": "user", "content": "x"}] and not chat.add_generation_prompt
    assert parse_detokenize({"tokens": [1, 2]}) == (None, [1, 2])
    for bad, parse in (({"prompt": 3}, parse_tokenize), ({}, parse_tokenize), ({"tokens": ["a"]}, parse_detokenize),
                       ({"tokens": 3}, parse_detokenize)):
        with pytest.raises(APIError) as caught:
            parse(bad)
        assert caught.value.status == 400


def test_new_params_survive_the_wire() -> None:
    params = SamplingParams(temperature=0.5, structured_output=StructuredOutputParams(regex="[0-9]+"),
                            logit_bias={3: 1.5, 9: -100.0}, prompt_logprobs=2)
    wire = params_to_wire(params)
    assert wire["logit_bias"] == [[3, 1.5], [9, -100.0]] and isinstance(wire["structured_output"], dict)
    msg = RequestMsg("r", [1], wire, "gw", 1.0, "m", priority=-3)
    assert msgpack.unpackb(encode(msg))["v"] == SCHEMA_VERSION == 10
    assert SamplingParams(**decode(RequestMsg, encode(msg)).params) == params
    assert decode(RequestMsg, encode(msg)).priority == -3


def test_prompt_logprobs_travel_once_in_a_reply_batch() -> None:
    prompt_lps = [None, [[5, -0.5], [6, -1.0]]]
    events = [("r", ReplyEvent(EventKind.OUTPUT, "e", "i", [ChoiceDelta(0, [7])], index=0, prompt_logprobs=prompt_lps)),
              ("r", ReplyEvent(EventKind.OUTPUT, "e", "i", [ChoiceDelta(0, [8], None, "stop")], True, index=1))]
    back = decode_batch(encode_batch(ReplyBatch("e", "i", events)))
    assert back.events[0][1].prompt_logprobs == prompt_lps and back.events[1][1].prompt_logprobs is None


def test_openapi_lists_the_new_fields() -> None:
    paths = openapi_document("m", CONFIG)["paths"]
    props = {route: paths[route]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
             for route in ("/v1/chat/completions", "/v1/completions")}
    for route_props in props.values():
        assert {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs", "logit_bias", "prompt_logprobs"} <= set(route_props)
        assert route_props["logit_bias"]["maxProperties"] == CONFIG.max_logit_bias
    assert {"tools", "tool_choice", "chat_template_kwargs"} <= set(props["/v1/chat/completions"])
    assert "tool_calls" in props["/v1/chat/completions"]["messages"]["items"]["properties"]
    assert props["/v1/completions"]["prompt"]["oneOf"][2]["maxItems"] == CONFIG.max_prompts
    assert "echo" in props["/v1/completions"] and {"/tokenize", "/detokenize"} <= set(paths)


# The demo template before issue 27: plain conversations must render exactly as they did.
OLD_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_demo_template_renders_plain_messages_as_before(add_generation_prompt: bool) -> None:
    env = ImmutableSandboxedEnvironment()
    messages = [{"role": r, "content": c} for r, c in
                (("system", "s"), ("user", "héllo"), ("assistant", "a\nb"), ("developer", "d"), ("user", ""))]
    for conversation in (messages, messages[1:], messages[:1]):
        old = env.from_string(OLD_TEMPLATE).render(messages=conversation, add_generation_prompt=add_generation_prompt)
        new = env.from_string(CHAT_TEMPLATE).render(messages=conversation, add_generation_prompt=add_generation_prompt)
        assert new == old


def test_demo_template_renders_tools_calls_results_and_no_thinking(tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "warm"}]
    text = tokenizer.decode(encode_chat(tokenizer, messages, True, tools, {"enable_thinking": False}))
    assert text.startswith("<|im_start|>system\nS\n\n# Tools\n") and text.count("<|im_start|>system") == 1
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = tokenizer.decode(encode_chat(tokenizer, messages[:2], True, None, {"enable_thinking": True}))
    assert thinking.endswith("<|im_start|>assistant\n")
