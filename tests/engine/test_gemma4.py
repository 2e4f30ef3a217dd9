"""Gemma 4 beyond the shared equivalence scenarios (tests/engine/test_hf_equivalence.py runs ARCH_CONFIGS["gemma4"]
and ["gemma4-moe"] in every one): forks and beams against transformers, the pool's room for shared layers, its RoPE
against transformers', --quantization int8 with the MoE, and the configs refused at load (its norms:
tests/engine/test_gemma.py)."""
from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

from engine.distributed.parallel_state import TensorParallel
from engine.layers.linear import Linear
from engine.layers.rotary import rope_config, rope_inv_freq
from engine.models.config import read_model_config
from engine.models.gemma4 import Gemma4ForCausalLM
from engine.models.moe import Router, StackedExperts
from loadtest.quant_quality import dequantized_copy
from .conftest import ARCH_CONFIGS, MAX_NEW_TOKENS, Checkpoint, build_checkpoint, hf_greedy, mixed_prompts
from .test_beam_search import check_against_hf, make_llm as beam_llm
from .test_gemma import write_config
from .test_hf_equivalence import SCENARIOS, check_greedy_forks, generate, make_llm

ARCH = "Gemma4ForCausalLM"
PROMPTS = mixed_prompts(6)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return build_checkpoint("gemma4", tmp_path_factory.mktemp("gemma4"))


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory):
    return build_checkpoint("gemma4-moe", tmp_path_factory.mktemp("gemma4-moe"))


@pytest.fixture(scope="module", params=["gemma4", "gemma4-moe"])
def multimodal(request, tmp_path_factory) -> tuple[Checkpoint, list[list[int]]]:
    """A Gemma4ForConditionalGeneration checkpoint as the hub ships them (the text model under
    model.language_model, its settings under text_config, a tiny vision tower beside it, the LM head tied by the
    top level's tie_word_embeddings: the text config's says false), and its greedy outputs for PROMPTS."""
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    config = transformers.Gemma4Config(text_config=ARCH_CONFIGS[request.param](), vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():  # drawn around their start of 1, as conftest draws the text models' (so they count)
        for name, param in model.model.language_model.named_parameters():
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                param.normal_(1.0, 0.5)
        for layer in model.model.language_model.layers:
            layer.layer_scalar.normal_(1.0, 0.5)
    folder = tmp_path_factory.mktemp(f"{request.param}-multimodal")
    model.save_pretrained(folder)
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    return Checkpoint(str(folder), model), [hf_greedy(model, p, MAX_NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("scenario", ["plain", "chunked"])
def test_multimodal_checkpoints_text_model_matches_transformers(multimodal, scenario):
    checkpoint, reference = multimodal
    llm = make_llm(checkpoint.path, "torch", **SCENARIOS[scenario])
    assert type(llm.engine.runner.model).__name__ == "Gemma4ForConditionalGeneration"
    assert generate(llm, PROMPTS) == reference


def test_multimodal_checkpoint_lacking_a_text_weight_fails_at_load(multimodal, tmp_path):
    path = multimodal[0].path
    weights = load_file(f"{path}/model.safetensors")
    del weights["model.language_model.layers.1.self_attn.o_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    shutil.copy(f"{path}/config.json", tmp_path)
    with pytest.raises(ValueError, match="lacks weights for: model.layers.1.self_attn.o_proj.weight"):
        make_llm(str(tmp_path), "torch")


@pytest.mark.parametrize("scenario", ["plain", "swap"])
@pytest.mark.parametrize("arch", ["gemma4", "gemma4_moe"])
def test_greedy_forks_match_transformers(request, arch, scenario):
    """n = 3 greedy choices share the prompt's blocks (the shared layers reading them too) and copy the last on
    write; each equals transformers' greedy run."""
    checkpoint = request.getfixturevalue(arch)
    check_greedy_forks(make_llm(checkpoint.path, "torch", **SCENARIOS[scenario]), checkpoint.hf_model, mixed_prompts(6))


def test_moe_quantization_flag_int8(gemma4_moe):
    """--quantization int8: attention, the dense MLP and the LM head per-channel int8; the router and the experts
    as they were (transformers' router projection is a linear layer, so the dequantised reference gets it back);
    greedy equal to transformers on those weights."""
    llm = make_llm(gemma4_moe.path, "ext", quantization="int8", enable_prefix_caching=False)
    model = llm.engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, StackedExperts)]
    assert len(experts) == 4 and all(m.w13.dtype == torch.float32 and m.activation == "gelu_tanh" for m in experts)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all((m.weight_scale is None) == isinstance(m, Router) for m in linears)
    reference = dequantized_copy(gemma4_moe.hf_model, "int8")
    for quantized, original in zip(reference.model.layers, gemma4_moe.hf_model.model.layers):
        quantized.router.proj.weight = original.router.proj.weight
    prompts = mixed_prompts(6)
    assert generate(llm, prompts) == [hf_greedy(reference, p, MAX_NEW_TOKENS) for p in prompts]


def test_beam_search_matches_transformers(gemma4):
    check_against_hf(beam_llm(gemma4.path, **SCENARIOS["swap"]), gemma4.hf_model, "gemma4", 4, False)


def test_shared_layers_take_no_room_in_the_pool(gemma4, tmp_path):
    """The last two layers (one local, one global) read layers 2 and 3's blocks: a token's K/V costs a third less
    (they hold a third of every kind's bytes), and the pools hold exactly that much per block."""
    config = ARCH_CONFIGS["gemma4"]()
    config.num_kv_shared_layers = 0
    unshared = make_llm(build_checkpoint("gemma4", tmp_path, config=config).path, "torch")
    llm = make_llm(gemma4.path, "torch")
    shared_bytes, unshared_bytes = llm.engine.config.kv_bytes_per_token, unshared.engine.config.kv_bytes_per_token
    assert unshared_bytes == 4 * 2 * 3 * (1 * 64 + 2 * 128)  # fp32, K and V, 3 local + 3 global layers
    assert shared_bytes == unshared_bytes * 2 // 3
    runner = llm.engine.runner
    blocks = llm.engine.config.scheduler.num_device_blocks
    assert sum(p.numel() * p.element_size() for p, _ in runner.pools) == shared_bytes * 16 * blocks
    layers = runner.model.attention_layers()
    assert [a.k_cache.data_ptr() for a in layers[4:]] == [a.k_cache.data_ptr() for a in layers[2:4]]
    assert [a.v_cache.data_ptr() for a in layers[4:]] == [a.v_cache.data_ptr() for a in layers[2:4]]


def test_proportional_rope_as_transformers():
    """Global layers: a quarter of the angle pairs turn, over the whole (global) head size; local ones: default."""
    config = ARCH_CONFIGS["gemma4"]()
    hf = Gemma4TextRotaryEmbedding(config)
    for kind, head_dim in (("full_attention", 128), ("sliding_attention", 64)):
        rope = rope_config(config.to_dict() | {"rope_parameters": config.rope_parameters[kind]}, head_dim, 256)
        assert torch.equal(rope_inv_freq(rope)[0], getattr(hf, f"{kind}_inv_freq"))


@pytest.mark.parametrize("extra, match", [
    ({"num_kv_shared_layers": 6}, r"num_kv_shared_layers=6 must be in \[0, num_hidden_layers=6\)"),
    ({"num_kv_shared_layers": 5}, "num_kv_shared_layers=5 leaves no earlier layer"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 3}, "layer_types must end with a full_attention"),
    ({"per_layer_config": {"1": {"head_dim": 128, "sliding_window": 8}}}, r"per_layer_config\['1'\]"),
    ({"vocab_size_per_layer_input": 100}, "vocab_size_per_layer_input=100 must cover"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
     "rope_parameters lacks the 'full_attention'"),
])
def test_configs_the_engine_cannot_run_fail_at_load(tmp_path, extra, match):
    path = write_config(tmp_path, ARCH_CONFIGS["gemma4"](), ARCH, **extra)
    with pytest.raises(ValueError, match=match):
        Gemma4ForCausalLM(read_model_config(path), torch.device("cpu"), torch.float32, TensorParallel())


@pytest.mark.parametrize("extra, match", [
    ({"num_experts": None}, "enable_moe_block needs num_experts a positive integer, got None"),
    ({"num_experts": 0}, "enable_moe_block needs num_experts a positive integer, got 0"),
    ({"moe_intermediate_size": "32"}, "enable_moe_block needs moe_intermediate_size a positive integer, got '32'"),
    ({"top_k_experts": 9}, r"top_k_experts=9 must be an integer in \[1, num_experts=8\]"),
    ({"top_k_experts": None}, r"top_k_experts=None must be an integer in \[1, num_experts=8\]"),
    ({"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
])
def test_moe_configs_the_engine_cannot_run_fail_at_load(tmp_path, extra, match):
    path = write_config(tmp_path, ARCH_CONFIGS["gemma4-moe"](), ARCH, **extra)
    with pytest.raises(ValueError, match=match):
        Gemma4ForCausalLM(read_model_config(path), torch.device("cpu"), torch.float32, TensorParallel())


def test_checkpoints_without_per_layer_config_read_global_head_dim(tmp_path):
    """Google's config.json names global_head_dim and num_global_key_value_heads; transformers 5 writes them
    as per_layer_config: both give the global layers the same shape."""
    config = ARCH_CONFIGS["gemma4"]()
    legacy = write_config(tmp_path, config, ARCH, drop=("per_layer_config",), global_head_dim=128,
                          num_global_key_value_heads=2)
    with open(f"{legacy}/config.json") as f:
        assert "per_layer_config" not in f.read()
    written = tmp_path / "written"
    written.mkdir()
    assert read_model_config(legacy).kv_layers() == read_model_config(write_config(written, config, ARCH)).kv_layers()
    assert transformers.Gemma4TextConfig.from_pretrained(legacy).per_layer_config[1].head_dim == 128
