"""SamplingParams.prompt_logprobs == transformers' fp32 log_softmax over the prompt (and its top k), whatever
the schedule: chunked prefill, a prefix-cache hit, recompute preemption, n > 1, mixed with ordinary requests."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, ResumeState, SamplingParams
from .conftest import MAX_NEW_TOKENS, backends, mixed_prompts
from .test_hf_equivalence import GREEDY, make_llm

K = 3
WITH_PROMPT = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, prompt_logprobs=K)

SCENARIOS = {
    "plain": dict(enable_prefix_caching=False),
    "chunked": dict(max_num_batched_tokens=16, enable_chunked_prefill=True, enable_prefix_caching=False),
    "recompute": dict(num_device_blocks=24, preemption_mode="recompute", enable_prefix_caching=True),
}


@torch.inference_mode()
def hf_prompt_logprobs(model, prompt: list[int], k: int) -> list:
    """The reference: entry 0 None, entry i the prompt token's logprob after tokens [0, i) and the top k."""
    logprobs = model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return [None] + [[(prompt[i], logprobs[i - 1, prompt[i]].item()),
                      *zip(top_ids[i - 1].tolist(), top_logprobs[i - 1].tolist())] for i in range(1, len(prompt))]


def assert_close(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], abs=1e-4)


def check_batch(llm: LLM, hf_model, prompts: list[list[int]]) -> None:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=WITH_PROMPT, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert_close(out.prompt_logprobs, hf_prompt_logprobs(hf_model, prompt, K))
        assert len(out.outputs[0].token_ids) == MAX_NEW_TOKENS


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_matches_hf(llama_checkpoint, scenario, backend):
    llm = make_llm(llama_checkpoint.path, backend, **SCENARIOS[scenario])
    check_batch(llm, llama_checkpoint.hf_model, mixed_prompts())
    stats = llm.engine.stats()
    if scenario == "recompute":
        assert stats.num_preemptions_total > 0
    assert stats.num_blocks_free == stats.num_blocks_total


def test_prefix_cache_hit_still_complete(llama_checkpoint):
    """The prompt is cached by an ordinary request first: the prompt-logprobs one still gets every entry."""
    llm = make_llm(llama_checkpoint.path, "torch", enable_prefix_caching=True)
    prompt = mixed_prompts()[1]  # 40 + a few tokens: its full blocks get cached
    llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
    for _ in range(2):
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=WITH_PROMPT, use_tqdm=False)[0]
        assert_close(out.prompt_logprobs, hf_prompt_logprobs(llama_checkpoint.hf_model, prompt, K))
    assert llm.engine.stats().prefix_cache_hits_total == 0  # the blocks were there, but not taken
    assert llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)[0].num_cached_tokens > 0


def test_mixed_batch_n2_and_k0(llama_checkpoint):
    """Ordinary requests batched with prompt-logprobs ones (n=2, k=0, a one-token prompt) sample as alone."""
    llm = make_llm(llama_checkpoint.path, "torch", max_num_batched_tokens=32, enable_chunked_prefill=True)
    prompts = mixed_prompts(6)
    solo = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for p in prompts[:3]]
    pair = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4, prompt_logprobs=1)
    k0 = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)  # lm-eval's loglikelihood request
    params = [GREEDY] * 3 + [pair, k0, k0]
    outputs = llm.generate(prompt_token_ids=prompts[:5] + [[7]], sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[:3]] == solo
    assert all(o.prompt_logprobs is None for o in outputs[:3])
    hf = llama_checkpoint.hf_model
    assert len(outputs[3].outputs) == 2
    assert_close(outputs[3].prompt_logprobs, hf_prompt_logprobs(hf, prompts[3], 1))
    assert_close(outputs[4].prompt_logprobs, hf_prompt_logprobs(hf, prompts[4], 0))
    assert all(len(entry) == 1 for entry in outputs[4].prompt_logprobs[1:])
    assert outputs[5].prompt_logprobs == [None] and len(outputs[5].outputs[0].token_ids) == 1


def test_first_output_only(llama_checkpoint):
    llm = make_llm(llama_checkpoint.path, "torch", max_num_batched_tokens=16, enable_chunked_prefill=True)
    prompt = mixed_prompts()[1]
    llm.engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2))
    seen = []
    while llm.engine.has_unfinished_requests():
        seen += [o.prompt_logprobs is not None for o in llm.engine.step()]
    assert seen == [True, False, False]
    assert not llm.engine.scheduler.prompt_logprobs


def test_beam_search_rejects_prompt_logprobs():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(n=2, use_beam_search=True, prompt_logprobs=1)


def test_tensor_parallel(llama_checkpoint):
    """tp = 2: the prompt rows' LM head runs on both ranks (its gather is collective), scored on rank 0."""
    llm = LLM(llama_checkpoint.path, skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
              num_device_blocks=64, num_threads=1, show_progress=False, max_num_batched_tokens=16,
              enable_chunked_prefill=True)
    try:
        check_batch(llm, llama_checkpoint.hf_model, mixed_prompts(4))
    finally:
        llm.engine.runner.shutdown()


def run_alone(llm: LLM, request_id: str) -> list:
    """Steps until the engine is idle; the outputs' prompt_logprobs, in order."""
    seen = []
    while llm.engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in llm.engine.step() if o.request_id == request_id]
    return seen


def test_recompute_mid_prefill_is_carried_once(llama_checkpoint):
    """Preempted (by recompute) between two prefill chunks: the re-prefill recomputes them, they go out once."""
    llm = make_llm(llama_checkpoint.path, "torch", max_num_batched_tokens=16, enable_chunked_prefill=True)
    prompt = mixed_prompts()[1]
    llm.engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K))
    llm.engine.step()  # the first chunk
    llm.engine.scheduler.isolate(list(llm.engine.scheduler.running.values()))
    first, *rest = run_alone(llm, "r")
    assert_close(first, hf_prompt_logprobs(llama_checkpoint.hf_model, prompt, K))
    assert all(p is None for p in rest)


def test_abort_mid_prefill_drops_them(llama_checkpoint):
    llm = make_llm(llama_checkpoint.path, "torch", max_num_batched_tokens=16, enable_chunked_prefill=True)
    llm.engine.add_request("r", mixed_prompts()[1], SamplingParams(max_tokens=2, prompt_logprobs=1))
    llm.engine.step()
    llm.engine.abort_request("r")
    assert run_alone(llm, "r") == [None] and not llm.engine.scheduler.prompt_logprobs


def test_resume(llama_checkpoint):
    """A resumed request that had delivered tokens already had its prompt logprobs; one that had none gets them."""
    llm = make_llm(llama_checkpoint.path, "torch")
    prompt, params = mixed_prompts()[1], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=K)
    llm.engine.add_request("delivered", prompt, params, resume=ResumeState([[5, 6]], [None]))
    assert all(p is None for p in run_alone(llm, "delivered"))
    llm.engine.add_request("none", prompt, params, resume=ResumeState([[]], [None]))
    first, *_ = run_alone(llm, "none")
    assert_close(first, hf_prompt_logprobs(llama_checkpoint.hf_model, prompt, K))
