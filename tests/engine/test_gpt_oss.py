"""gpt-oss beyond the shared equivalence scenarios: its router and experts against transformers' modules (bf16
too), the expert layout read per tensor-parallel rank, forked sequences (n > 1) token-exact, and config.json fields
the engine cannot run failing at load, named."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HFExperts, GptOssTopKRouter

from cuda_ext import reference
from engine import SamplingParams
from engine.distributed.parallel_state import TensorParallel
from engine.models.gpt_oss import GptOssExperts, GptOssMoeBlock
from .conftest import ARCH_CONFIGS, MAX_NEW_TOKENS, build_checkpoint, hf_greedy, mixed_prompts
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
    for name in os.listdir(gpt_oss.path):
        os.symlink(os.path.join(gpt_oss.path, name), tmp_path / name)
    with open(os.path.join(gpt_oss.path, "config.json")) as f:
        config = json.load(f)
    os.unlink(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps(config | {field: value}))
    with pytest.raises(ValueError, match=message):
        make_llm(str(tmp_path), "torch")
