"""LLM.generate greedy == transformers generate(do_sample=False), token for token, fp32, one batch of 16."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.layers.linear import Linear
from .conftest import MAX_NEW_TOKENS, TEST_DEVICE, backends, hf_greedy, mixed_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)

# Scenario -> EngineConfig overrides. 16 prompts of up to 70 tokens + 20 new ones need
# ~70 blocks of 16 at once, so 24 blocks force preemption.
SCENARIOS = {
    "plain": dict(enable_prefix_caching=False),
    "recompute": dict(num_device_blocks=24, preemption_mode="recompute", enable_prefix_caching=False),
    "swap": dict(num_device_blocks=24, num_cpu_blocks=24, preemption_mode="swap", enable_prefix_caching=False),
    "prefix": dict(enable_prefix_caching=True),
    "chunked": dict(max_num_batched_tokens=16, enable_chunked_prefill=True),
}


def make_llm(path: str, backend: str, **overrides) -> LLM:
    config = dict(attention_backend=backend, dtype="float32", num_device_blocks=256, show_progress=False,
                  device=TEST_DEVICE)
    return LLM(path, skip_tokenizer_init=True, **(config | overrides))


def check_greedy_forks(llm: LLM, hf_model, prompts: list[list[int]]) -> None:
    """n = 3 greedy choices per prompt (forks of its sequence once the prompt is in): each equals transformers'
    greedy run."""
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert [c.token_ids for c in output.outputs] == [hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)] * 3


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_matches_hf(checkpoint, hf_reference, scenario, backend):
    llm = make_llm(checkpoint.path, backend, **SCENARIOS[scenario])
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    packed = backend == "ext" and TEST_DEVICE == "cpu"  # the skinny GEMM is CPU's
    assert linears and all((m.packed is not None) == packed for m in linears)
    prompts = mixed_prompts()
    assert generate(llm, prompts) == hf_reference
    stats = llm.engine.stats()
    if scenario == "recompute":
        assert stats.num_preemptions_total > 0
    if scenario == "swap":
        assert stats.num_swapped_out_blocks_total > 0 and stats.num_swapped_in_blocks_total > 0
    if scenario == "prefix":
        # The second pass finds every prompt's full blocks cached.
        assert generate(llm, prompts) == hf_reference
        assert llm.engine.stats().prefix_cache_hits_total > 0
    assert stats.num_blocks_free == stats.num_blocks_total  # everything returned to the pool


@pytest.mark.parametrize("scenario", ["plain", "chunked"])
def test_split_attention_kernel_matches_hf(checkpoint, hf_reference, scenario):
    """attention_kernel="split" reaches every layer: the reference's model of the split kernels decodes exactly."""
    from cuda_ext import reference
    from engine.layers.attention import PagedAttention

    llm = make_llm(checkpoint.path, "torch", attention_kernel="split", **SCENARIOS[scenario])
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PagedAttention)]
    assert layers and all(m.ops.paged_attention is reference.paged_attention_split for m in layers)
    assert generate(llm, mixed_prompts()) == hf_reference
