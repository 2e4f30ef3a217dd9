"""OpenAI's Responses API (/v1/responses) with the official openai SDK (responses.create, .stream and .parse),
checked against the chat completion of the same conversation (one chat path: the same greedy text), with a forced
function call's round trip through function_call / function_call_output items, structured output, and errors."""
from __future__ import annotations

import json
from typing import Annotated

import jsonschema
import openai
import pydantic
import pytest

from service import responses_api
from service.local_stack import LocalStack
from tests.service.conftest import API_KEY, MODEL_NAME, OTHER_KEY

INSTRUCTIONS = "You answer arithmetic questions."
QUESTION = "What is 17 plus 25?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}


class Verdict(pydantic.BaseModel):  # bounded values: the demo model's noise cannot run past max_output_tokens
    correct: bool


@pytest.fixture(scope="module")
def client(roomy_stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{roomy_stack.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat_answer(client) -> tuple[str, str]:
    """(text, finish reason) of the chat completion of the same conversation."""
    answer = client.chat.completions.create(model=MODEL_NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    return answer.choices[0].message.content, answer.choices[0].finish_reason


@pytest.fixture(scope="module")
def chat_text(chat_answer) -> str:
    return chat_answer[0]


def test_a_response_says_what_the_chat_path_says(client, chat_answer) -> None:
    chat_text, finish = chat_answer
    response = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=QUESTION,
                                       max_output_tokens=12, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat_text and [item.type for item in response.output] == ["message"]
    assert response.status == ("incomplete" if finish == "length" else "completed")
    assert 0 < response.usage.output_tokens <= 12


def test_an_item_list_input_is_the_same_conversation(client, chat_text) -> None:
    items = [{"type": "message", "role": "developer", "content": INSTRUCTIONS},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    response = client.responses.create(model=MODEL_NAME, input=items, max_output_tokens=12, temperature=0)
    assert response.output_text == chat_text


def test_the_stream_is_the_responses_event_sequence(client, chat_text) -> None:
    with client.responses.stream(model=MODEL_NAME, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.delta" in kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat_text
    assert final.output_text == chat_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_round_trip(client, stream: bool) -> None:
    args = dict(model=MODEL_NAME, input="The weather in Paris?", tools=[WEATHER], max_output_tokens=200,
                tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    if stream:
        with client.responses.stream(**args) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**args)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = client.responses.create(model=MODEL_NAME, tools=[WEATHER], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "The weather in Paris?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete") and follow.output


def test_parse_gives_the_schema_s_object(client) -> None:
    parsed = client.responses.parse(model=MODEL_NAME, input=QUESTION, text_format=Verdict, max_output_tokens=40,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, Verdict) and parsed.status == "completed"


def test_stored_responses_continue_read_delete_and_stay_with_their_key(client, roomy_stack: LocalStack,
                                                                         chat_text) -> None:
    """store (the default) keeps a response for previous_response_id and GET; another API key finds nothing;
    DELETE removes it; a non-background response cannot be cancelled."""
    first = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=QUESTION,
                                    max_output_tokens=12, temperature=0)
    assert first.store and client.responses.retrieve(first.id).output_text == first.output_text == chat_text
    follow = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, input="And 1 more?",
                                     max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": chat_text},
        {"role": "user", "content": "And 1 more?"}])  # instructions are not carried over, as OpenAI's API does
    assert follow.previous_response_id == first.id and follow.output_text == chat.choices[0].message.content
    with client.responses.stream(model=MODEL_NAME, previous_response_id=follow.id, input="Thanks.",
                                 max_output_tokens=4, temperature=0) as stream:
        last = list(stream)[-1]  # response.incomplete at the 4 tokens, as OpenAI's (get_final_response wants completed)
    streamed = last.response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    stranger = openai.OpenAI(base_url=f"{roomy_stack.url}/v1", api_key=OTHER_KEY, max_retries=0)
    for call in (lambda: stranger.responses.retrieve(first.id), lambda: stranger.responses.delete(first.id),
                 lambda: stranger.responses.create(model=MODEL_NAME, previous_response_id=first.id, input="x",
                                                   max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_what_is_not_supported_is_a_400_that_names_it(client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=4, background=True)
    assert refused.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError) as image:  # the demo model takes no images
        client.responses.create(model=MODEL_NAME, max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}])
    assert image.value.body["param"] == "messages[0].content[0].image_url" and "text-only" in image.value.message
    with pytest.raises(openai.BadRequestError) as file:
        client.responses.create(model=MODEL_NAME, max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_file", "file_id": "f"}]}])
    assert file.value.body["param"] == "input[0].content[0].type"


def test_the_agents_sdk_runs_a_function_tool_to_completion(roomy_stack: LocalStack) -> None:
    """The Agents SDK's default model speaks the Responses API: its first turn is forced to call the tool (the
    demo model was never trained on calls), the tool runs, and the run ends with the model's answer."""
    agents = pytest.importorskip("agents")
    client = openai.AsyncOpenAI(base_url=f"{roomy_stack.url}/v1", api_key=API_KEY, max_retries=0)
    calls = []

    @agents.function_tool
    def get_weather(city: Annotated[str, pydantic.Field(pattern="^[A-Za-z ]{1,12}$")]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny, 21 C"

    agent = agents.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model=MODEL_NAME, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=200,
                                                             temperature=0))
    # A question the demo model answers and ends (its tool call is forced; its last turn is free).
    result = agents.Runner.run_sync(agent, QUESTION, max_turns=4,
                                    run_config=agents.RunConfig(tracing_disabled=True))
    assert len(calls) == 1 and isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


def test_langchain_on_the_responses_api(roomy_stack: LocalStack, chat_text) -> None:
    """LangChain's ChatOpenAI with use_responses_api=True: the same answer as the chat path, and a bound tool
    called through function_call items."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL_NAME, base_url=f"{roomy_stack.url}/v1", api_key=API_KEY,
                                      use_responses_api=True, temperature=0, max_tokens=12, max_retries=0)
    answer = llm.invoke([("system", INSTRUCTIONS), ("user", QUESTION)])
    assert answer.text == chat_text
    tool = {k: WEATHER[k] for k in ("name", "description", "parameters")}
    roomy = llm.model_copy(update={"max_tokens": 200})  # the call's JSON must close within the limit
    called = roomy.bind_tools([tool], tool_choice="get_weather").invoke("Paris?")
    (call,) = called.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["parameters"])


def test_an_error_mid_stream_is_numbered_after_the_events_sent() -> None:
    """The SDK's stream reader orders events by sequence_number: an error event goes after the text sent."""
    stream = responses_api.ResponseStream(responses_api.Envelope("resp_1", MODEL_NAME, {"input": "hi"}, 0))
    sent = [*stream.start(), *stream.feed({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})]
    assert [event["sequence_number"] for _, event in sent] == list(range(len(sent)))
    name, event = stream.error("internal_error", "boom", None)
    assert (name, event["sequence_number"], event["message"]) == ("error", len(sent), "boom")
