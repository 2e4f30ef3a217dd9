"""Beam search over the API, through the whole stack, with the official openai client, against transformers."""
from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.service.conftest import API_KEY, MODEL_NAME, get_json

PROMPT_TEXT = "Hello, world"  # sent as token ids
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def prompt(demo_model: str) -> list[int]:
    return AutoTokenizer.from_pretrained(demo_model).encode(PROMPT_TEXT)


@pytest.fixture(scope="module")
def hf_beams(demo_model: str):
    """transformers' beams for a prompt: their generated tokens, best first (eos never stops them)."""
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], width: int, **kwargs) -> list[list[int]]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 num_beams=width, num_return_sequences=width, eos_token_id=2**20, pad_token_id=0,
                                 return_dict_in_generate=True, **kwargs)
        lengths = (out.beam_indices >= 0).sum(-1).tolist()
        return [out.sequences[i, len(prompt_ids):len(prompt_ids) + n].tolist() for i, n in enumerate(lengths)]

    return generate


@pytest.mark.parametrize("n, best_of, length_penalty, early_stopping", [(2, 4, 1.0, False), (3, None, 0.5, "never")])
def test_completions_return_the_best_beams(client, hf_beams, demo_model, prompt, n, best_of, length_penalty,
                                           early_stopping):
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    extra = {"use_beam_search": True, "length_penalty": length_penalty, "early_stopping": early_stopping,
             "ignore_eos": True} | ({"best_of": best_of} if best_of else {})
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, n=n, max_tokens=MAX_TOKENS, extra_body=extra)
    beams = hf_beams(prompt, best_of or n, length_penalty=length_penalty, early_stopping=early_stopping)[:n]
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == list(range(n))
    assert [c.text for c in choices] == [tokenizer.decode(b, skip_special_tokens=True) for b in beams]
    assert all(c.finish_reason == "length" for c in choices)
    # Every generated token once per returned choice.
    assert out.usage.completion_tokens == sum(len(b) for b in beams)
    assert out.usage.prompt_tokens == len(prompt)


def test_chat_returns_n_beams(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi there"}], n=2,
                                         max_tokens=MAX_TOKENS, extra_body={"use_beam_search": True, "best_of": 3,
                                                                            "ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 2 * MAX_TOKENS


@pytest.mark.parametrize("extra, param", [
    ({"use_beam_search": True, "best_of": 2}, "n"),  # n=3 > the beam width
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ({"best_of": 4}, "best_of"),  # best_of != n needs beam search
])
def test_invalid_beam_requests_are_400(client, prompt, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt=prompt, n=3, max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param


def test_streaming_beam_search_is_a_clear_400(client, prompt):
    with pytest.raises(openai.BadRequestError, match="cannot be streamed") as err:
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, stream=True,
                                  extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "use_beam_search"


def test_openapi_lists_the_beam_fields(stack):
    status, doc = get_json(f"{stack.url}/openapi.json")
    assert status == 200
    for path in ("/v1/completions", "/v1/chat/completions"):
        props = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
        assert props["use_beam_search"] == {"type": "boolean", "default": False}
        assert props["length_penalty"] == {"type": "number", "default": 1.0}
        assert props["best_of"]["minimum"] == 1 and props["best_of"]["maximum"] == props["n"]["maximum"]
        assert {"enum": ["never"]} in props["early_stopping"]["oneOf"]
