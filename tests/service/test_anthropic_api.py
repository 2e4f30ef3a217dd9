"""Anthropic's Messages API (/v1/messages) with the official anthropic SDK, checked against the chat completion of
the same conversation (one chat path: the same greedy text), with its streaming events, stop sequences, a forced
tool call's round trip, token counting and Anthropic's error shape."""
from __future__ import annotations

import jsonschema
import openai
import pytest

from service.local_stack import LocalStack
from tests.service.conftest import API_KEY, MODEL_NAME, get_json, post_json

anthropic = pytest.importorskip("anthropic")

MESSAGES = [{"role": "user", "content": "What is 17 plus 25?"}]
SYSTEM = "You answer arithmetic questions."
GREEDY = {"temperature": 0}  # the SDK of 2026 has no sampling fields; older clients send them, and so do these tests
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(roomy_stack: LocalStack):
    return anthropic.Anthropic(base_url=roomy_stack.url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat_text(roomy_stack: LocalStack) -> str:
    """The chat completion of the same conversation, greedy: what /v1/messages must say too."""
    chat = openai.OpenAI(base_url=f"{roomy_stack.url}/v1", api_key=API_KEY, max_retries=0)
    answer = chat.chat.completions.create(model=MODEL_NAME, max_tokens=12, temperature=0,
                                          messages=[{"role": "system", "content": SYSTEM}, *MESSAGES])
    return answer.choices[0].message.content


def test_a_message_says_what_the_chat_path_says(client, chat_text) -> None:
    message = client.messages.create(model=MODEL_NAME, max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                     messages=MESSAGES)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL_NAME
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == chat_text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert message.id.startswith("msg_") and 0 < message.usage.output_tokens <= 12 and message.usage.input_tokens > 0


def test_the_stream_carries_the_same_text_as_anthropics_events(client, chat_text) -> None:
    with client.messages.stream(model=MODEL_NAME, max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                messages=MESSAGES) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == chat_text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0


def test_a_stop_sequence_ends_the_message_and_is_named(client, chat_text) -> None:
    stop = chat_text.strip()[1:3]  # a sequence the greedy text reaches after its first character
    message = client.messages.create(model=MODEL_NAME, max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                     messages=MESSAGES, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert chat_text.startswith(message.content[0].text) and stop not in message.content[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_round_trip(client, stream: bool) -> None:
    args = dict(model=MODEL_NAME, max_tokens=200, extra_body=GREEDY, tools=[WEATHER],
                tool_choice={"type": "tool", "name": "get_weather"},
                messages=[{"role": "user", "content": "The weather in Paris?"}])
    if stream:
        with client.messages.stream(**args) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**args)
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and message.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    follow = client.messages.create(model=MODEL_NAME, max_tokens=8, extra_body=GREEDY, tools=[WEATHER], messages=[
        *args["messages"], {"role": "assistant", "content": [call.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]}])
    assert follow.type == "message" and follow.content


def test_count_tokens_counts_what_the_template_renders(client, roomy_stack: LocalStack) -> None:
    counted = client.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES)
    status, tokenized = post_json(f"{roomy_stack.url}/tokenize", {"model": MODEL_NAME, "messages": [
        {"role": "system", "content": SYSTEM}, *MESSAGES]})
    assert status == 200 and counted.input_tokens == tokenized["count"] > 0


def test_errors_take_anthropics_shape_and_name_the_field(client, roomy_stack: LocalStack) -> None:
    status, missing = post_json(f"{roomy_stack.url}/v1/messages", {"model": MODEL_NAME, "messages": MESSAGES})  # no max_tokens
    assert status == 400 and missing["type"] == "error" and missing["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing["error"]["message"]
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]
    with pytest.raises(anthropic.BadRequestError) as unsupported:  # the demo model takes no images
        client.messages.create(model=MODEL_NAME, max_tokens=4, messages=image)
    assert "text-only" in unsupported.value.body["error"]["message"]
    document = [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}]
    with pytest.raises(anthropic.BadRequestError) as unsupported:
        client.messages.create(model=MODEL_NAME, max_tokens=4, messages=document)
    assert "messages[0].content[0].type" in unsupported.value.body["error"]["message"]
    stranger = anthropic.Anthropic(base_url=roomy_stack.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        stranger.messages.create(model=MODEL_NAME, max_tokens=4, messages=MESSAGES)
    assert denied.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="another-model", max_tokens=4, messages=MESSAGES)
    assert get_json(f"{roomy_stack.url}/v1/models")[0] == 200  # the server is fine after all of it

