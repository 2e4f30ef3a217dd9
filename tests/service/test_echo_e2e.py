"""echo, prompt logprobs, lists of prompts and logit_bias on /v1/completions, through the whole stack,
checked against transformers' log_softmax on the demo checkpoint (fp32)."""
from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from service.local_stack import LocalStack
from tests.service.conftest import API_KEY, MODEL_NAME

ATOL = 1e-4
GREEDY = {"temperature": 0.0}
PROMPT = "Paged attention keeps the KV cache in blocks."


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def hf_model(demo_model: str):
    return AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_log_softmax(hf_model):
    """The reference: row i is log p(. | ids[:i + 1]), so token i's logprob is row i - 1 at ids[i]."""
    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    return run


def reference_prompt_logprobs(rows: torch.Tensor, ids: list[int]) -> list[float]:
    return [rows[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_logprobs_match_transformers(client, tokenizer, hf_log_softmax) -> None:
    ids = tokenizer.encode(PROMPT)
    rows = hf_log_softmax(ids)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 3
    assert "".join(lp.tokens[:len(ids)]) == PROMPT
    assert lp.token_logprobs[0] is None  # nothing predicts the first token
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(reference_prompt_logprobs(rows, ids), abs=ATOL)
    for i in range(1, len(ids)):  # the top 2 of each prompt position, against the reference's
        top = torch.topk(rows[i - 1], 2)
        expected = {tokenizer.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
        assert lp.top_logprobs[i].keys() == expected.keys(), i
        assert [lp.top_logprobs[i][k] for k in expected] == pytest.approx(list(expected.values()), abs=ATOL)
    # the generated tail: greedy from the whole prompt
    assert lp.tokens[len(ids)] == tokenizer.decode([int(rows[-1].argmax())])
    assert lp.token_logprobs[len(ids)] == pytest.approx(rows[-1].max().item(), abs=ATOL)
    assert lp.text_offset[:len(ids)] == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 3


def test_echo_with_max_tokens_zero_scores_the_prompt_only(client, tokenizer, hf_log_softmax) -> None:
    """vLLM's scoring request, what lm-eval's loglikelihood sends with max_tokens=0."""
    ids = tokenizer.encode(PROMPT)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    choice = out.choices[0]
    assert choice.text == PROMPT
    assert len(choice.logprobs.token_logprobs) == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        reference_prompt_logprobs(hf_log_softmax(ids), ids), abs=ATOL)
    assert out.usage.completion_tokens == 0


def test_vllm_prompt_logprobs_extra(client, tokenizer, hf_log_softmax) -> None:
    ids = tokenizer.encode(PROMPT)
    rows = hf_log_softmax(ids)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, n=2, seed=3,
                                    extra_body={"prompt_logprobs": 1})
    for choice in out.choices:
        listed = choice.model_extra["prompt_logprobs"]
        assert len(listed) == len(ids) and listed[0] is None
        for i in range(1, len(ids)):
            entry = listed[i]
            assert entry[str(ids[i])]["logprob"] == pytest.approx(rows[i - 1, ids[i]].item(), abs=ATOL)
            best = int(rows[i - 1].argmax())
            assert entry[str(best)]["rank"] == 1
            assert entry[str(best)]["logprob"] == pytest.approx(rows[i - 1, best].item(), abs=ATOL)
            assert set(entry) == {str(ids[i]), str(best)}


def test_prompt_list_choices_are_prompt_index_times_n_plus_j(client, tokenizer) -> None:
    prompts = ["first prompt", "the second one", "3"]
    n = 2
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4, n=n, seed=11, echo=True,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == list(range(len(prompts) * n))
    for choice in out.choices:
        assert choice.text.startswith(prompts[choice.index // n]), (choice.index, choice.text)
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == len(prompts) * n * 4
    # token-id prompts, without echo: each matches the same prompt sent alone (greedy)
    lists = [tokenizer.encode(p) for p in prompts]
    batch = client.completions.create(model=MODEL_NAME, prompt=lists, max_tokens=5, **GREEDY,
                                      extra_body={"ignore_eos": True})
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=5, **GREEDY,
                                       extra_body={"ignore_eos": True}).choices[0].text for p in lists]
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == alone


def test_logit_bias_forces_and_bans_tokens(client, tokenizer, hf_log_softmax) -> None:
    ids = tokenizer.encode(PROMPT)
    forced = tokenizer.encode("q")[0]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, logit_bias={str(forced): 100},
                                    logprobs=0, extra_body={"ignore_eos": True}, **GREEDY)
    assert out.choices[0].text == "q" * 8
    greedy_first = int(hf_log_softmax(ids)[-1].argmax())
    assert greedy_first != forced
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1,
                                    logit_bias={str(greedy_first): -100}, extra_body={"ignore_eos": True}, **GREEDY)
    assert out.choices[0].text != tokenizer.decode([greedy_first])
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, logit_bias={str(forced): 100},
                                          extra_body={"ignore_eos": True}, **GREEDY)
    assert chat.choices[0].message.content == "q" * 6


@pytest.mark.parametrize("bias", [{"999999": 1}, {"5": 101}, {"abc": 1}, {"5": "high"}, {"-1": 1}])
def test_bad_logit_bias_is_a_400(client, bias) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, logit_bias=bias)
    assert exc.value.status_code == 400
    assert exc.value.param == "logit_bias", exc.value.body


def test_bad_prompt_in_a_list_is_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt=["ok", ""], max_tokens=1)
    assert exc.value.param == "prompt", exc.value.body
