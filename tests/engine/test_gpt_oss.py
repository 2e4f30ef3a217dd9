"""gpt-oss beyond the shared equivalence scenarios: its router and experts against transformers' modules (bf16
too), the expert layout read per tensor-parallel rank, forked sequences (n > 1) token-exact, config.json fields
the engine cannot run failing at load, named, and MXFP4 experts (OpenAI's checkpoints) dequantized at load."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HFExperts, GptOssTopKRouter

from cuda_ext import reference
from engine import SamplingParams, mxfp4
from engine.distributed.parallel_state import TensorParallel
from engine.models.gpt_oss import GptOssExperts, GptOssMoeBlock
from .conftest import ARCH_CONFIGS, MAX_NEW_TOKENS, Checkpoint, build_checkpoint, hf_greedy, mixed_prompts
from .test_hf_equivalence import generate, make_llm


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return build_checkpoint("gpt-oss", tmp_path_factory.mktemp("gpt-oss"))


def moe_block(llm) -> GptOssMoeBlock:
    return next(m for m in llm.engine.runner.model.modules() if isinstance(m, GptOssMoeBlock))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_matches_transformers_router(gpt_oss, dtype):
    llm = make_llm(gpt_oss.path, "torch", dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    block = moe_block(llm)
    router = GptOssTopKRouter(ARCH_CONFIGS["gpt-oss"]()).to(dtype)
    with torch.no_grad():
        router.weight.copy_(block.router.weight), router.bias.copy_(block.router.bias)
    x = torch.randn(64, router.hidden_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    _, want_weights, want_ids = router(x)
    weights, ids = block.routing.route(F.linear(x, router.weight, router.bias))
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights.float())


def test_experts_match_transformers(gpt_oss):
    """The checkpoint's interleaved gate|up read into [gate | up] rows: the same outputs as transformers' loop."""
    block = moe_block(make_llm(gpt_oss.path, "torch"))
    hf = gpt_oss.hf_model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, hf.hidden_size, generator=gen)
    ids = torch.rand(40, hf.num_experts, generator=gen).topk(2, dim=-1).indices
    weights = torch.rand(40, 2, generator=gen).softmax(dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(block.experts(x, weights, ids), hf(x, ids, weights), atol=1e-4, rtol=1e-4)


def test_each_rank_reads_its_share_of_the_experts(gpt_oss):
    """Two ranks' halves of the intermediate size, run side by side and summed (the all-reduce), equal one rank."""
    hf: HFExperts = gpt_oss.hf_model.model.layers[1].mlp.experts
    tensors = {"w13": hf.gate_up_proj, "w13_bias": hf.gate_up_proj_bias, "w2": hf.down_proj, "w2_bias": hf.down_proj_bias}

    def experts(rank: int, size: int) -> GptOssExperts:
        module = GptOssExperts(hf.num_experts, hf.hidden_size, hf.intermediate_size, "intermediate_size",
                               TensorParallel(rank=rank, size=size), bias=True, swiglu=(hf.alpha, hf.limit))
        for attr, t in tensors.items():
            getattr(module, attr).data.copy_(module.reshuffle(attr, t.detach()))
        return module

    x = torch.randn(8, hf.hidden_size, generator=torch.Generator().manual_seed(2))
    ids, weights = torch.tensor([[0, 5]] * 8), torch.full((8, 2), 0.5)

    def run(m: GptOssExperts) -> torch.Tensor:  # the module's op without its all-reduce
        return reference.fused_moe(x, m.w13, m.w2, ids, weights, m.w13_bias, m.w2_bias, *m.swiglu)

    with torch.no_grad():
        halves = sum(run(experts(rank, 2)) for rank in range(2))
        torch.testing.assert_close(halves, run(experts(0, 1)), atol=1e-4, rtol=1e-4)


def test_forks_match_hf(gpt_oss):
    """n = 2 forks every prompt after its prefill (shared blocks, copy-on-write), prefix caching on."""
    prompts = mixed_prompts(6)
    reference = [hf_greedy(gpt_oss.hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    llm = make_llm(gpt_oss.path, "torch", enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, n=2)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[r, r] for r in reference]
    assert generate(make_llm(gpt_oss.path, "torch"), prompts) == reference


@pytest.mark.parametrize("field, value, message", [
    ("swiglu_limit", 0, "swiglu_limit must be a positive number, got 0"),
    ("swiglu_alpha", "fast", "swiglu_alpha must be a positive number, got 'fast'"),
    ("layer_types", ["sliding_attention", "chunked_attention"], "layer_types may hold .* got \\['chunked_attention'\\]"),
    ("attention_bias", False, "attention_bias must be true"),
    ("num_local_experts", 0, "num_local_experts must be a positive integer, got 0"),
    ("rope_parameters", None, "needs its rope_parameters"),
])
def test_bad_config_fails_at_load_naming_the_field(gpt_oss, tmp_path, field, value, message):
    variant(gpt_oss.path, tmp_path, {field: value})
    with pytest.raises(ValueError, match=message):
        make_llm(str(tmp_path), "torch")


def variant(source: str, folder, config: dict, tensors: dict[str, torch.Tensor] | None = None) -> str:
    """``source``'s checkpoint in ``folder`` with ``config`` merged into its config.json and, given ``tensors``,
    those as its only weights; the other files linked."""
    replaced = {"config.json"} | ({"model.safetensors"} if tensors is not None else set())
    for name in set(os.listdir(source)) - replaced:
        os.symlink(os.path.join(source, name), folder / name)
    with open(os.path.join(source, "config.json")) as f:
        (folder / "config.json").write_text(json.dumps(json.load(f) | config))
    if tensors is not None:
        save_file(tensors, folder / "model.safetensors")
    return str(folder)


MXFP4_CONFIG = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., n] -> (blocks [..., n / 32, 16], scales [..., n / 32]), uint8, from the format's description: per 32
    values an E8M0 scale (2 ** (byte - 127)) bringing their largest magnitude into [4, 8) (E2M1 tops out at 6),
    each value the nearest E2M1 code (bit 3 the sign), two codes a byte, the even value in the low nibble."""
    groups = w.float().unflatten(-1, (-1, 32))
    exponent = torch.log2(groups.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -100)).floor() - 2
    scaled = groups / torch.exp2(exponent)
    codes = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(-1) | scaled.signbit().long() << 3
    blocks = codes[..., 0::2] | codes[..., 1::2] << 4
    return blocks.to(torch.uint8), (exponent.squeeze(-1) + 127).to(torch.uint8)


def mxfp4_tensors(hf_model) -> dict[str, torch.Tensor]:
    """``hf_model``'s weights with its experts' projections packed, in place of which the model gets them
    dequantized by transformers."""
    tensors = {}
    for name, t in hf_model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out], packed along in
            blocks, scales = pack_mxfp4(t.transpose(1, 2))
            tensors |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
            t.copy_(convert_moe_packed_tensors(blocks, scales, dtype=t.dtype))
        else:
            tensors[name] = t.contiguous()
    return tensors


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory) -> Checkpoint:
    hf = copy.deepcopy(gpt_oss.hf_model)
    folder = variant(gpt_oss.path, tmp_path_factory.mktemp("gpt-oss-mxfp4"), MXFP4_CONFIG, mxfp4_tensors(hf))
    return Checkpoint(folder, hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_packer_round_trips_through_transformers(dtype):
    """The test's packer and the engine's dequantization against transformers': the same values, each within a
    quarter of its block's largest magnitude of the packed weight, packed again to the same bytes."""
    w = torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 96)
    blocks, scales = pack_mxfp4(w)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    assert torch.equal(mxfp4.dequantize(blocks, scales, dtype).transpose(1, 2), want)
    back = want.transpose(1, 2).float()
    bound = w.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True) / 4
    assert ((back - w).abs().unflatten(-1, (-1, 32)) <= bound).all()
    assert all(torch.equal(a, b) for a, b in zip(pack_mxfp4(back), (blocks, scales)))


def test_mxfp4_checkpoint_matches_hf_holding_the_dequantized_experts(gpt_oss_mxfp4):
    prompts = mixed_prompts(6)
    reference = [hf_greedy(gpt_oss_mxfp4.hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    assert generate(make_llm(gpt_oss_mxfp4.path, "torch"), prompts) == reference


def test_mxfp4_is_refused_for_other_families(llama_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="quant_method 'mxfp4' is supported for gpt-oss's experts only, not Llama"):
        make_llm(variant(llama_checkpoint.path, tmp_path, MXFP4_CONFIG), "torch")


@pytest.mark.parametrize("change, message", [
    ("attention", "'model.layers.0.self_attn.q_proj.weight_blocks': MXFP4 .* ending in .experts.gate_up_proj"),
    ("no scales", "'model.layers.1.mlp.experts.down_proj_blocks' has no 'model.layers.1.mlp.experts.down_proj_sca"),
])
def test_mxfp4_beyond_the_experts_is_refused_naming_the_tensor(gpt_oss_mxfp4, tmp_path, change, message):
    tensors = mxfp4_tensors(copy.deepcopy(gpt_oss_mxfp4.hf_model))
    if change == "attention":
        blocks, scales = pack_mxfp4(tensors.pop("model.layers.0.self_attn.q_proj.weight"))
        tensors |= {"model.layers.0.self_attn.q_proj.weight_blocks": blocks,
                    "model.layers.0.self_attn.q_proj.weight_scales": scales}
    else:
        del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    with pytest.raises(ValueError, match=message):
        make_llm(variant(gpt_oss_mxfp4.path, tmp_path, {}, tensors), "torch")
