"""Hybrid recurrent-state models (Qwen3-Next, Qwen3.5) beyond the shared equivalence scenarios
(tests/engine/test_hf_equivalence.py runs ARCH_CONFIGS["qwen3-next"] and ["qwen3.5"] in every one, tp=2 in
tests/engine/test_tensor_parallel.py): forks and beams copying the state, prefix hits restoring a snapshot, the state
pool's memory arithmetic, every slot back after aborts, int8, and the configs refused at load."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.layers.linear import Linear
from loadtest.quant_quality import dequantized_copy
from .conftest import ARCH_CONFIGS, MAX_NEW_TOKENS, build_checkpoint, hf_greedy, mixed_prompts
from .test_beam_search import check_against_hf, make_llm as beam_llm
from .test_gemma import write_config
from .test_hf_equivalence import SCENARIOS, check_greedy_forks, generate, make_llm


@pytest.fixture(scope="module", params=["qwen3-next", "qwen3.5"])
def hybrid(request, tmp_path_factory):
    checkpoint = build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    checkpoint.arch = request.param
    return checkpoint


def _slot_bytes(config) -> int:
    """One sequence's state: each linear layer's conv window (fp32 here) and fp32 recurrent matrices."""
    channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim + \
        config.linear_num_value_heads * config.linear_value_head_dim
    conv = channels * (config.linear_conv_kernel_dim - 1) * 4
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    return config.layer_types.count("linear_attention") * (conv + recurrent)


@pytest.mark.parametrize("scenario", ["plain", "swap"])
def test_greedy_forks_match_transformers(hybrid, scenario):
    """n = 3 greedy choices: each fork copies the parent's state slot; each equals transformers' greedy run."""
    llm = make_llm(hybrid.path, "ext", **SCENARIOS[scenario])
    check_greedy_forks(llm, hybrid.hf_model, mixed_prompts(6))
    assert llm.engine.scheduler.kv.state.stats().num_used_slots == 0


def test_beam_search_matches_transformers(hybrid):
    check_against_hf(beam_llm(hybrid.path, **SCENARIOS["swap"]), hybrid.hf_model, "qwen3-next", 4, False)


def test_a_prefix_hit_restores_the_state_snapshot(hybrid):
    """A prompt, then its continuation as the next turn's prompt: the second starts from the first's snapshot
    (its last block boundary) and its cached blocks, and still equals transformers."""
    llm = make_llm(hybrid.path, "ext", enable_prefix_caching=True)
    first = mixed_prompts(1)[0] + list(range(1, 30))
    turn = generate(llm, [first])[0]
    second = first + turn + [7, 8, 9]
    assert generate(llm, [second]) == [hf_greedy(hybrid.hf_model, second, MAX_NEW_TOKENS)]
    stats = llm.engine.stats()
    assert stats.state_snapshot_hits_total == 1 and stats.num_state_snapshots_used >= 1
    assert stats.prefix_cache_hits_total == (len(first) - 1) // 16 * 16


def test_the_state_pool_comes_out_of_the_kv_budget(hybrid):
    """Slots for max_num_seqs sequences plus as many snapshots, each one sequence's state; the K/V budget gets
    what is left, and only the full-attention layer holds K/V."""
    slot = _slot_bytes(ARCH_CONFIGS[hybrid.arch]())
    budget = 1 << 20  # under max_num_seqs full-length sequences' blocks, which would cap the pool
    llm = make_llm(hybrid.path, "ext", num_device_blocks=None, kv_cache_memory_bytes=budget, max_num_seqs=8)
    resolved = llm.engine.config
    assert resolved.state_slot_bytes == slot
    assert resolved.kv_bytes_per_token == 2 * 1 * 64 * 4  # one attention layer, K and V, one head of 64, fp32
    assert resolved.scheduler.num_state_slots == resolved.scheduler.num_state_snapshots == 8
    assert resolved.scheduler.num_device_blocks == (budget - 16 * slot) // (16 * resolved.kv_bytes_per_token)
    pools = llm.engine.runner.state_pools
    assert sum(dev.numel() * dev.element_size() for dev, _ in pools) == 16 * slot


def test_aborts_return_every_slot(hybrid):
    llm = make_llm(hybrid.path, "ext", enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=8)
    engine = llm.engine
    for i, prompt in enumerate(mixed_prompts(6)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request([str(i) for i in range(6)])
    engine.step()
    stats = engine.stats()
    assert stats.num_state_slots_total == 8 and stats.num_state_slots_used == 0
    assert stats.num_blocks_free == stats.num_blocks_total


def test_int8_matches_transformers_on_the_dequantized_weights(hybrid):
    llm = make_llm(hybrid.path, "ext", quantization="int8", enable_prefix_caching=False)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.quantizable]
    assert linears and all(m.weight_scale is not None for m in linears)
    reference = dequantized_copy(hybrid.hf_model, "int8")
    prompts = mixed_prompts(6)
    assert generate(llm, prompts) == [hf_greedy(reference, p, MAX_NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("extra, match", [
    ({"linear_num_value_heads": 3}, "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types has no 'full_attention' layer"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types must list 3 entries"),
    ({"linear_key_head_dim": 0}, "linear_key_head_dim must be a positive integer"),
])
def test_bad_configs_are_refused_at_load(tmp_path, extra, match):
    path = write_config(tmp_path, ARCH_CONFIGS["qwen3.5"](), "Qwen3_5ForCausalLM", **extra)
    with pytest.raises(ValueError, match=match):
        make_llm(path, "torch")


def test_speculative_decoding_is_refused(hybrid):
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        make_llm(hybrid.path, "torch", speculative_method="ngram")
