"""Sampler behaviour against independent references: HF logits processors, exact distributions, seeds."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler
from engine.sequence import Sequence

from .conftest import hf_greedy, mixed_prompts


def make_llm(path: str, **overrides) -> LLM:
    config = dict(attention_backend="torch", dtype="float32", num_device_blocks=256, show_progress=False)
    return LLM(path, skip_tokenizer_init=True, **(config | overrides))


def tokens(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                         use_tqdm=False)]


# ---- the sampler alone, on fixed logits --------------------------------------
def draw(logits: list[float], params: SamplingParams, rows: int = 20000) -> torch.Tensor:
    """Empirical token frequencies of ``rows`` independent draws."""
    sampler = Sampler(eos_token_ids=set(), seed=0)
    seq = Sequence([0], 1)
    batch = torch.tensor([logits]).repeat(rows, 1)
    picked = torch.tensor(sampler(batch, [seq] * rows, [params] * rows).token_ids)
    return torch.bincount(picked, minlength=len(logits)).float() / rows


LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0]


def expected(keep: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Softmax restricted to ``keep``, computed directly."""
    probs = torch.zeros(len(LOGITS))
    weights = torch.tensor([LOGITS[i] / temperature for i in keep]).softmax(0)
    probs[keep] = weights
    return probs


@pytest.mark.parametrize("params, keep", [
    (SamplingParams(temperature=1.0), [0, 1, 2, 3, 4, 5]),
    (SamplingParams(temperature=1.0, top_k=3), [0, 1, 2]),
    # softmax(LOGITS) ~ [.40, .24, .15, .09, .05, .02]: top_p=0.7 keeps the first three.
    (SamplingParams(temperature=1.0, top_p=0.7), [0, 1, 2]),
    # min_p=0.3 keeps tokens with p >= 0.3 * p_max = 0.12.
    (SamplingParams(temperature=1.0, min_p=0.3), [0, 1, 2]),
])
def test_sampling_distribution(params, keep):
    assert torch.allclose(draw(LOGITS, params), expected(keep), atol=0.015)


def test_temperature_sharpens_distribution():
    assert torch.allclose(draw(LOGITS, SamplingParams(temperature=0.5)), expected(list(range(6)), 0.5), atol=0.015)


def test_penalties_match_formula():
    """Frequency/presence subtract count-weighted terms of output tokens; repetition scales seen tokens."""
    sampler = Sampler(eos_token_ids=set(), seed=0)
    seq = Sequence([1, 2, 2, 3, 3], num_prompt_tokens=1)  # prompt [1], outputs [2, 2, 3, 3]
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0)
    got = sampler._penalize(logits, [seq], [params])
    want = torch.tensor([[0.0, 1.0 / 2, 2.0 / 2 - 1.0 - 0.25, -1.0 * 2 - 1.0 - 0.25, 0.5]])
    assert torch.allclose(got, want)


def test_fused_argmax_stands_only_for_untouched_logits():
    """The LM head's fused argmax gives the greedy tokens unless a penalty or min_tokens changed the logits."""
    sampler = Sampler(eos_token_ids={1}, seed=0)
    seq = Sequence([0, 2], num_prompt_tokens=1)
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    fused = torch.tensor([3])  # deliberately not the argmax: shows which one was used
    assert sampler(logits, [seq], [SamplingParams(temperature=0.0)], fused).token_ids == [3]
    assert sampler(logits, [seq], [SamplingParams(temperature=0.0, min_tokens=5)], fused).token_ids == [2]  # no eos
    assert sampler(logits, [seq], [SamplingParams(temperature=0.0, repetition_penalty=2.0)], fused).token_ids == [1]
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)]
    assert sampler(logits.repeat(2, 1), [seq, seq], mixed, torch.tensor([3, 3])).token_ids == [3, 1]


def test_argmax_only_params_and_a_step_without_logits():
    """Greedy rows that read nothing else of the logits take the LM head's argmax alone (no logits at all)."""
    assert SamplingParams(temperature=0.0, stop_token_ids=[5], ignore_eos=True).argmax_only
    greedy_but = [dict(logprobs=0), dict(min_tokens=2), dict(presence_penalty=1), dict(frequency_penalty=1),
                  dict(repetition_penalty=2), dict(n=2, best_of=2, use_beam_search=True)]
    for params in [SamplingParams(temperature=1.0)] + [SamplingParams(temperature=0.0, **kw) for kw in greedy_but]:
        assert not params.argmax_only, params
    sampler = Sampler(eos_token_ids={1}, seed=0)
    seq = Sequence([0, 2], num_prompt_tokens=1)
    out = sampler(None, [seq, seq], [SamplingParams(temperature=0.0)] * 2, torch.tensor([3, 7]))
    assert out.token_ids == [3, 7] and out.logprobs == [None, None]


# ---- end to end against HF ---------------------------------------------------
def test_repetition_penalty_matches_hf(llama_checkpoint):
    prompts = mixed_prompts(6, seed=3)
    llm = make_llm(llama_checkpoint.path)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=20, ignore_eos=True)
    want = [hf_greedy(llama_checkpoint.hf_model, p, 20, repetition_penalty=1.5) for p in prompts]
    assert tokens(llm, prompts, params) == want


def test_min_tokens_and_stop_token_match_hf(llama_checkpoint):
    """stop_token_ids + min_tokens behave as HF's eos_token_id + min_new_tokens."""
    prompts = mixed_prompts(6, seed=4)
    llm = make_llm(llama_checkpoint.path)
    for prompt in prompts:
        stop = hf_greedy(llama_checkpoint.hf_model, prompt, 3)[1]  # a token greedy decoding likes
        params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=4, stop_token_ids=[stop])
        want = hf_greedy(llama_checkpoint.hf_model, prompt, 20, eos_token_id=stop, min_new_tokens=4)
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == want
        assert out.finish_reason == ("stop" if out.token_ids[-1] == stop else "length")
        assert stop not in out.token_ids[:4]


@torch.inference_mode()
def test_logprobs_match_hf(llama_checkpoint):
    prompt = mixed_prompts(1, seed=5)[0]
    llm = make_llm(llama_checkpoint.path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
    full = torch.tensor([prompt + out.token_ids])
    ref = llama_checkpoint.hf_model(full).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    assert len(out.logprobs) == 8
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top = ref[i].topk(3)
        assert entry[0][0] == token  # the sampled token first, then the top 3 by falling logprob
        assert {t for t, _ in entry[1:]} == set(top.indices.tolist())
        assert [lp for _, lp in entry[1:]] == sorted((lp for _, lp in entry[1:]), reverse=True)
        for t, lp in entry:
            assert lp == pytest.approx(ref[i, t].item(), abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(e[0][1] for e in out.logprobs), abs=1e-4)


def test_seeded_request_same_alone_and_in_batch(llama_checkpoint):
    llm = make_llm(llama_checkpoint.path)
    prompts = mixed_prompts(9, seed=6)
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = tokens(llm, prompts[:1], seeded)[0]
    others = [SamplingParams(temperature=t, top_p=0.8, max_tokens=8 + i, ignore_eos=True, seed=None if i % 2 else i)
              for i, t in enumerate([0.0, 0.7, 1.0, 1.3, 0.5, 1.0, 0.0, 2.0])]
    in_batch = tokens(llm, prompts, [seeded] + others)[0]
    assert in_batch == alone
    other_seed = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=99, max_tokens=16, ignore_eos=True)
    assert tokens(llm, prompts[:1], other_seed)[0] != alone


def test_top_k_one_is_greedy(llama_checkpoint):
    llm = make_llm(llama_checkpoint.path)
    prompts = mixed_prompts(4, seed=7)
    greedy = tokens(llm, prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert tokens(llm, prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True)) == greedy


# ---- parallel sampling ---------------------------------------------------------
def peak_used_blocks(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> tuple[int, list]:
    engine = llm.engine
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    peak, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        peak = max(peak, engine.stats().num_blocks_used)
    return peak, outputs


def test_n_greater_than_one_shares_prompt_blocks(llama_checkpoint):
    prompt = mixed_prompts(2, seed=8)[1][:64]  # 4 full blocks of 16
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    single = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    forked_peak, outputs = peak_used_blocks(make_llm(llama_checkpoint.path, enable_prefix_caching=False),
                                            [(prompt, params)])
    separate_peak, _ = peak_used_blocks(make_llm(llama_checkpoint.path, enable_prefix_caching=False),
                                        [(prompt, single)] * 4)
    assert forked_peak < separate_peak
    choices: dict[int, list[int]] = {}
    for out in outputs:
        for c in out.outputs:
            choices.setdefault(c.index, []).extend(c.token_ids)
    assert sorted(choices) == [0, 1, 2, 3]
    assert all(len(t) == 12 for t in choices.values())
    assert len({tuple(t) for t in choices.values()}) > 1  # the choices diverge


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=1.5), dict(n=0),
    dict(max_tokens=0), dict(min_tokens=5, max_tokens=2), dict(logprobs=100), dict(presence_penalty=3.0),
    dict(repetition_penalty=0.0), dict(stop_token_ids=[-1]),
])
def test_invalid_sampling_params_raise(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name.split("_")[0]):
        SamplingParams(**kwargs)
