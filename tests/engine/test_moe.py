"""MoE routing against transformers' routers (bf16 too: where each family rounds), the tiny test models' routing
spread over every expert, and config.json fields or checkpoint tensors the engine cannot run failing at load."""
from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from engine.models.moe import SparseMoeBlock
from .conftest import ARCH_CONFIGS, build_checkpoint, mixed_prompts
from .test_hf_equivalence import make_llm

MOE_ARCHS = ["mixtral", "qwen2-moe", "qwen3-moe"]
HF_ROUTERS = {"mixtral": MixtralTopKRouter, "qwen2-moe": Qwen2MoeTopKRouter, "qwen3-moe": Qwen3MoeTopKRouter}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routing_matches_transformers_router(tmp_path, arch, dtype):
    checkpoint = build_checkpoint(arch, tmp_path)
    llm = make_llm(checkpoint.path, "torch", dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    block = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock))
    router = HF_ROUTERS[arch](ARCH_CONFIGS[arch]()).to(dtype)
    with torch.no_grad():
        router.weight.copy_(block.gate.weight)
    x = torch.randn(64, router.hidden_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    _, want_weights, want_ids = router(x)
    weights, ids = block.routing.route(F.linear(x, router.weight))
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_weights.float())  # Qwen's rounded to bf16, Mixtral's fp32


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_test_models_route_to_every_expert(tmp_path, arch):
    """The token-exact tests exercise real routing: the mixed prompts reach every expert of every sparse layer."""
    checkpoint = build_checkpoint(arch, tmp_path)
    llm = make_llm(checkpoint.path, "torch")
    picked: list[set[int]] = []
    for block in (m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)):
        seen: set[int] = set()
        picked.append(seen)

        def record(module, args, logits, seen=seen, routing=block.routing):
            seen.update(routing.route(logits)[1].flatten().tolist())

        block.gate.register_forward_hook(record)
    llm.generate(prompt_token_ids=mixed_prompts(), use_tqdm=False)
    assert picked and all(seen == set(range(8)) for seen in picked)


def test_more_experts_per_token_than_experts_fails_at_load(tmp_path):
    checkpoint = build_checkpoint("qwen3-moe", tmp_path)
    with open(os.path.join(checkpoint.path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(checkpoint.path, "config.json"), "w") as f:
        json.dump(config | {"num_experts_per_tok": 9}, f)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be in \[1, num_local_experts=8\]"):
        make_llm(checkpoint.path, "torch")


# Families whose MoE is a checkpoint option: the model decides per checkpoint (test_gemma4_moe_decodes_eagerly).
_OPTIONAL_MOE = {"Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"}


def test_moe_models_decode_eagerly():
    """fused_moe syncs with the host on CUDA, so no MoE model is captured as a CUDA graph."""
    from engine.models import FAMILIES

    moe = [cls for family in FAMILIES if family.moe for cls in family.classes.values()
           if cls.__name__ not in _OPTIONAL_MOE]
    dense = [cls for family in FAMILIES if not family.moe for cls in family.classes.values()]
    names = {cls.__name__ for cls in moe}
    assert {"MixtralForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM", "Qwen3NextForCausalLM"} <= names
    assert not any(cls.graph_capturable for cls in moe)
    assert all(getattr(cls, "graph_capturable", True) for cls in dense)


@pytest.mark.parametrize("moe_block", [False, True])
def test_gemma4_moe_decodes_eagerly(tmp_path, moe_block):
    from engine.distributed.parallel_state import TensorParallel
    from engine.models.config import read_model_config
    from engine.models.gemma4 import Gemma4ForCausalLM
    from .test_gemma import write_config

    path = write_config(tmp_path, ARCH_CONFIGS["gemma4-moe" if moe_block else "gemma4"](), "Gemma4ForCausalLM")
    with torch.device("meta"):
        model = Gemma4ForCausalLM(read_model_config(path), torch.device("meta"), torch.float32, TensorParallel())
    assert model.graph_capturable is not moe_block


@pytest.mark.parametrize("tensor", ["model.layers.0.mlp.experts.3.down_proj.weight",
                                    "model.layers.0.mlp.experts.5.up_proj.weight",
                                    "model.layers.0.mlp.shared_expert.up_proj.weight",
                                    "model.layers.0.self_attn.k_proj.bias"])
def test_a_checkpoint_missing_one_expert_or_fused_part_fails_at_load(tmp_path, tensor):
    """One expert's tensor, or one part of a fused layer, absent: the load names it (the stacked or fused
    parameter is filled otherwise, and that part would be uninitialised memory)."""
    checkpoint = build_checkpoint("qwen2-moe", tmp_path)
    (file,) = glob.glob(os.path.join(checkpoint.path, "*.safetensors"))
    weights = load_file(file)
    del weights[tensor]
    save_file(weights, file)
    with pytest.raises(ValueError, match=re.escape(f"lacks weights for: {tensor}")):
        make_llm(checkpoint.path, "torch")
