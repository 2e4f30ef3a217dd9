"""DeepSeek-V3 beyond the shared equivalence scenarios (tests/engine/test_hf_equivalence.py runs
ARCH_CONFIGS["deepseek-v3"] in every one): the latent pool's bytes and capacity, an int8 latent, --quantization
int8, forks and the full-rank query variant against transformers, routing, RoPE and softmax scale against
transformers' modules, refused configs."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention, DeepseekV3RotaryEmbedding,
                                                                  DeepseekV3TopkRouter)

from engine.distributed.parallel_state import TensorParallel
from engine.layers.linear import Linear
from engine.layers.rotary import rope_config, rope_inv_freq
from engine.models.config import read_model_config
from engine.models.deepseek import DeepseekV3ForCausalLM, GroupedRouting
from engine.models.moe import Router
from loadtest.quant_quality import dequantized_copy
from .conftest import ARCH_CONFIGS, MAX_NEW_TOKENS, backends, build_checkpoint, hf_greedy, mixed_prompts
from .test_gemma import write_config
from .test_hf_equivalence import SCENARIOS, check_greedy_forks, generate, make_llm

ARCH = "DeepseekV3ForCausalLM"


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return build_checkpoint("deepseek-v3", tmp_path_factory.mktemp("deepseek-v3"))


def test_latent_is_stored_once_and_multiplies_capacity(deepseek):
    """A token costs (kv_lora_rank + qk_rope_head_dim) x layers x 4 bytes in fp32, one tensor bound as both K and V;
    an MHA layout of the same heads (4 x (48 + 32) per layer, K and V) costs 5x that, so one budget holds 5x the
    blocks."""
    mla_bytes, mha_bytes = (48 + 16) * 2 * 4, 4 * (48 + 32) * 2 * 4
    budget = 10 * mha_bytes * 16  # ten MHA blocks of 16 tokens
    llm = make_llm(deepseek.path, "torch", num_device_blocks=None, kv_cache_memory_bytes=budget)
    config, runner = llm.engine.config, llm.engine.runner
    assert config.kv_bytes_per_token == mla_bytes and mha_bytes == 5 * mla_bytes
    assert config.scheduler.num_device_blocks == 50
    (pool, _), = runner.pools
    assert pool.shape == (50, 2, 1, 1, 16, 64) and pool.numel() * pool.element_size() == mla_bytes * 16 * 50
    assert all(a.k_cache.data_ptr() == a.v_cache.data_ptr() for a in runner.model.attention_layers())


@pytest.mark.parametrize("backend", backends())
def test_int8_latent_cache(deepseek, backend):
    """An int8 latent: one-byte codes and a 2-byte scale per slot, once (66 bytes a token and layer); preempting by
    swap reproduces the plain quantized run."""
    prompts = mixed_prompts(6)
    plain = make_llm(deepseek.path, backend, kv_cache_dtype="int8")
    assert plain.engine.config.kv_bytes_per_token == 2 * (64 + 2)
    swapped = make_llm(deepseek.path, backend, kv_cache_dtype="int8", **SCENARIOS["swap"])
    assert generate(swapped, prompts) == generate(plain, prompts)


def test_quantization_flag_int8(deepseek):
    """--quantization int8: the query and latent projections, o_proj, the dense and shared MLPs and the LM head
    per-channel int8; kv_b_proj (applied absorbed), the router and the experts as they were; greedy equal to
    transformers on those weights."""
    llm = make_llm(deepseek.path, "torch", quantization="int8", enable_prefix_caching=False)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and not isinstance(m, Router)]
    assert all(m.weight_scale is not None for m in linears)
    reference = dequantized_copy(deepseek.hf_model, "int8")
    for quantized, original in zip(reference.model.layers, deepseek.hf_model.model.layers):
        quantized.self_attn.kv_b_proj.weight = original.self_attn.kv_b_proj.weight
    prompts = mixed_prompts(6)
    assert generate(llm, prompts) == [hf_greedy(reference, p, MAX_NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("scenario", ["plain", "swap"])
def test_greedy_forks_match_transformers(deepseek, scenario):
    """n = 3 greedy choices share the prompt's latent blocks and copy the last on write."""
    check_greedy_forks(make_llm(deepseek.path, "torch", **SCENARIOS[scenario]), deepseek.hf_model, mixed_prompts(6))


def test_full_rank_query_plain_rope_matches_transformers(tmp_path):
    """No q_lora_rank (one q_proj), rope_interleave false, default RoPE (softmax scale 1 / sqrt(qk_head_dim))."""
    config = ARCH_CONFIGS["deepseek-v3"]()
    config.q_lora_rank, config.rope_interleave = None, False
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    checkpoint = build_checkpoint("deepseek-v3", tmp_path, config=config)
    prompts = mixed_prompts(6)
    want = [hf_greedy(checkpoint.hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    assert generate(make_llm(checkpoint.path, "torch"), prompts) == want


def test_routing_matches_transformers():
    """Grouped top-k by the biased sigmoid scores, weights from the unbiased ones, renormalised and scaled."""
    config = ARCH_CONFIGS["deepseek-v3"]()
    torch.manual_seed(0)
    router = DeepseekV3TopkRouter(config)
    router.weight.data.normal_(0, 0.3)
    router.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(256, config.hidden_size)
    _, hf_weights, hf_ids = router(x)
    routing = GroupedRouting(num_experts=8, top_k=2, num_groups=4, top_groups=2, renormalize=True, scaling=2.5)
    weights, ids = routing.route(x @ router.weight.T, router.e_score_correction_bias)
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=0, atol=1e-6)
    assert len(ids.unique()) == 8  # every expert reached


def test_yarn_rope_and_softmax_scale_as_transformers(deepseek):
    """The rope dims' frequencies and attention factor (mscale / mscale_all_dim), and the softmax scale
    1 / sqrt(qk_head_dim) x mscale(mscale_all_dim)^2 rather than the 64-wide cached head's."""
    config = ARCH_CONFIGS["deepseek-v3"]()
    hf = DeepseekV3RotaryEmbedding(config)
    inv_freq, factor = rope_inv_freq(rope_config(config.to_dict(), 16, 256))
    assert torch.equal(inv_freq, hf.inv_freq) and factor == hf.attention_scaling != 1.0
    llm = make_llm(deepseek.path, "torch")
    scale = DeepseekV3Attention(config, 0).scaling
    assert scale != 48 ** -0.5 and {a.scale for a in llm.engine.runner.model.attention_layers()} == {scale}


@pytest.mark.parametrize("extra, match", [
    ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive integer"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim must be even"),
    ({"q_lora_rank": 0}, "q_lora_rank must be null or a positive integer"),
    ({"n_group": 3}, "n_group must be a divisor of n_routed_experts=8"),
    ({"topk_group": 5}, "topk_group must be at most n_group=4"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok must be at most the experts of topk_group groups"),
    ({"first_k_dense_replace": 3}, r"first_k_dense_replace must be an integer in \[0, num_hidden_layers=2\]"),
    ({"scoring_func": "softmax"}, "scoring_func must be \"sigmoid\""),
    ({"hidden_act": "gelu"}, "hidden_act must be \"silu\""),
])
def test_configs_the_engine_cannot_run_fail_at_load(tmp_path, extra, match):
    path = write_config(tmp_path, ARCH_CONFIGS["deepseek-v3"](), ARCH, **extra)
    with pytest.raises(ValueError, match=match):
        DeepseekV3ForCausalLM(read_model_config(path), torch.device("cpu"), torch.float32, TensorParallel())


def test_the_multi_token_prediction_layer_is_skipped(deepseek, tmp_path):
    """Released checkpoints carry a speculative layer past num_hidden_layers (model.layers.61.* in DeepSeek-V3): it
    loads without it; an unknown weight of a served layer is still refused."""
    folder = tmp_path / "with-mtp"
    shutil.copytree(deepseek.path, folder)
    layers = ARCH_CONFIGS["deepseek-v3"]().num_hidden_layers
    save_file({f"model.layers.{layers}.eh_proj.weight": torch.zeros(4, 8)}, folder / "mtp.safetensors")
    prompts = mixed_prompts(2)
    assert generate(make_llm(str(folder), "torch"), prompts) == [hf_greedy(deepseek.hf_model, p, MAX_NEW_TOKENS)
                                                                 for p in prompts]
    save_file({"model.layers.0.eh_proj.weight": torch.zeros(4, 8)}, folder / "mtp.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.eh_proj.weight"):
        make_llm(str(folder), "torch")
