"""Structured outputs through the whole stack with the openai SDK. The demo model never saw JSON in training,
so only the grammar makes what it writes valid, and every answer is checked independently of the
grammar (jsonschema, re.fullmatch, the choice list)."""
from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from service.local_stack import LocalStack
from tests.service.conftest import API_KEY, MODEL_NAME

# Enough for the noise to close every bounded string and array of the schemas below (measured: the longest
# answers are well under half of it); finish_reason "stop" is asserted, so a cut-off answer fails.
MAX_TOKENS = 600
MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]

# Strings are bounded by patterns here; free text bounded by maxLength has its own test below.
ADDRESS = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z ]{0,7}$"},
                                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
           "required": ["city", "zip"], "additionalProperties": False}
USER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_ -]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                 "minItems": 2, "maxItems": 4},
        "address": ADDRESS,
    },
    "required": ["name", "age", "role", "active", "tags", "address"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "user", "schema": USER, "strict": True}}
REGEX = r"[A-Z][a-z]{2,6}-[0-9]{1,3}(\.[0-9]{2})?"
CHOICES = ["alpha", "beta", "gamma delta", "ε-epsilon"]


@pytest.fixture(scope="module")
def client(roomy_stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{roomy_stack.url}/v1", api_key=API_KEY, max_retries=0)


def chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, **kwargs)


def valid_user(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, USER)
    return value


def streamed_chat(client: openai.OpenAI, **kwargs) -> dict[int, tuple[str, str | None]]:
    """Each choice's (content, finish_reason) put together from the deltas."""
    parts: dict[int, list[str]] = {}
    reasons: dict[int, str | None] = {}
    for chunk in chat(client, stream=True, **kwargs):
        for c in chunk.choices:
            parts.setdefault(c.index, []).append(c.delta.content or "")
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return {i: ("".join(p), reasons.get(i)) for i, p in parts.items()}


def test_json_schema_strict_every_answer_validates(client) -> None:
    out = chat(client, response_format=JSON_SCHEMA_FORMAT, n=4, seed=5)
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
        valid_user(choice.message.content)
    # noise: four samples of one request differ
    assert len({c.message.content for c in out.choices}) > 1


def test_same_seed_same_structured_answers(client) -> None:
    first = chat(client, response_format=JSON_SCHEMA_FORMAT, n=4, seed=21)
    second = chat(client, response_format=JSON_SCHEMA_FORMAT, n=4, seed=21)
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert all(valid_user(c.message.content) for c in first.choices)


def test_json_schema_streamed(client) -> None:
    streamed = streamed_chat(client, response_format=JSON_SCHEMA_FORMAT, n=2, seed=8)
    assert sorted(streamed) == [0, 1]
    for text, reason in streamed.values():
        assert reason == "stop", text
        valid_user(text)
    whole = chat(client, response_format=JSON_SCHEMA_FORMAT, n=2, seed=8)
    assert [streamed[c.index][0] for c in whole.choices] == [c.message.content for c in whole.choices]


def test_guided_json_on_completions(client) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="user: ", max_tokens=MAX_TOKENS, n=3, seed=2,
                                    extra_body={"guided_json": USER})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.text
        valid_user(choice.text)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="user: ", max_tokens=MAX_TOKENS, seed=4,
                                            stream=True, extra_body={"guided_json": json.dumps(USER)}))
    valid_user("".join(c.choices[0].text for c in chunks if c.choices))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_object(client, tokenizer) -> None:
    """Any JSON object (not any JSON value): unbounded strings, so a logit bias on '"' and '}' keeps the answer
    short (the demo model never saw JSON: its strings run on past max_tokens with a bias of 6)."""
    bias = {str(tokenizer.convert_tokens_to_ids(c)): 12 for c in '"}'}
    out = chat(client, response_format={"type": "json_object"}, n=4, seed=9, logit_bias=bias)
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_guided_regex(client, stream: bool) -> None:
    if stream:
        texts = [t for t, reason in streamed_chat(client, n=3, seed=1, extra_body={"guided_regex": REGEX}).values()
                 if reason == "stop"]
    else:
        out = chat(client, n=3, seed=1, extra_body={"guided_regex": REGEX})
        assert all(c.finish_reason == "stop" for c in out.choices)
        texts = [c.message.content for c in out.choices]
    assert len(texts) == 3
    for text in texts:
        assert re.fullmatch(REGEX, text), text


def test_guided_regex_and_choice_on_completions(client) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="id:", max_tokens=40, n=4, seed=6,
                                    extra_body={"guided_regex": REGEX})
    assert all(c.finish_reason == "stop" and re.fullmatch(REGEX, c.text) for c in out.choices), out.choices
    out = client.completions.create(model=MODEL_NAME, prompt="pick:", max_tokens=40, n=4, seed=6,
                                    extra_body={"guided_choice": CHOICES})
    assert all(c.finish_reason == "stop" and c.text in CHOICES for c in out.choices), out.choices


def test_guided_choice(client) -> None:
    # Hot sampling: the demo model, sure of one choice at temperature 1, still picks more than one of four in
    # eight independent samples.
    out = chat(client, n=8, seed=3, temperature=4.0, extra_body={"guided_choice": CHOICES})
    picked = [c.message.content for c in out.choices]
    assert all(c.finish_reason == "stop" for c in out.choices)
    assert set(picked) <= set(CHOICES), picked
    assert len(set(picked)) > 1
    streamed = streamed_chat(client, n=2, seed=3, extra_body={"guided_choice": CHOICES})
    assert all(text in CHOICES and reason == "stop" for text, reason in streamed.values()), streamed


class Address(BaseModel):
    city: str = Field(pattern=r"^[A-Za-z ]{1,8}$")
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Note(BaseModel):
    title: str = Field(min_length=1, max_length=6)
    body: str = Field(max_length=12)


class Person(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z]{1,10}$")
    age: int = Field(ge=0, le=120)
    kind: Literal["cat", "dog", "fish"]
    homes: list[Address] = Field(min_length=1, max_length=2)


def test_sdk_parse_returns_a_pydantic_object(client) -> None:
    """The SDK sends the model's strict schema (with $defs / $ref) and parses the answer back."""
    out = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                        response_format=Person, seed=13)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person), message.content
    assert message.parsed == Person.model_validate_json(message.content)
    assert 1 <= len(message.parsed.homes) <= 2


def test_free_text_bounded_by_max_length_is_valid_json(client) -> None:
    """Any character but the ones JSON forbids unescaped (U+0000-U+001F, '"', '\\'): noise writes them all."""
    schema = Note.model_json_schema()
    out = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "note", "schema": schema,
                                                                               "strict": True}}, n=4, seed=17)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    parsed = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                           response_format=Note, seed=17)
    assert isinstance(parsed.choices[0].message.parsed, Note)


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_structured_output_is_a_400(client, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, extra_body=extra)
    assert exc.value.status_code == 400
    assert exc.value.param == param, exc.value.body
