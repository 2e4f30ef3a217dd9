"""Gemma specifics against transformers: the (1 + weight) norm's rounding, soft-capped logits as logprobs, the
layer windows and RoPE tables of configs written before transformers 5, and configs the engine cannot run."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm as HFGemma4RMSNorm

from engine.distributed.parallel_state import TensorParallel
from engine.layers.norm import Gemma4RMSNorm, GemmaRMSNorm
from engine.layers.rotary import rope_inv_freq
from engine.models.config import read_model_config
from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from .conftest import ARCH_CONFIGS, backends, build_checkpoint, mixed_prompts
from .test_hf_equivalence import make_llm
from .test_prompt_logprobs import check_batch

SMALL = dict(vocab_size=64, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
             intermediate_size=256, max_position_embeddings=256, sliding_window=16)


# transformers' norm and the engine's: Gemma 2/3's 1 + weight, Gemma 4's weight, Gemma 4's value norm (no weight).
NORMS = {"gemma2": lambda: (Gemma2RMSNorm(96, eps=1e-6), GemmaRMSNorm(96, eps=1e-6)),
         "gemma4": lambda: (HFGemma4RMSNorm(96, eps=1e-6), Gemma4RMSNorm(96, eps=1e-6)),
         "gemma4-value": lambda: (HFGemma4RMSNorm(96, eps=1e-6, with_scale=False),
                                  Gemma4RMSNorm(96, eps=1e-6, scaled=False))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_rounds_as_transformers(norm, dtype):
    hf, ours = NORMS[norm]()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.5)
        ours.load_state_dict(hf.state_dict())
    hf, ours = hf.to(dtype), ours.to(dtype)
    x = (torch.randn(7, 96, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    assert torch.equal(ours(x), hf(x))


@pytest.mark.parametrize("backend", backends())
def test_soft_capped_logits_give_transformers_logprobs(tmp_path, backend):
    """final_logit_softcapping = 3 squeezes every logit into (-3, 3): the prompt logprobs see the cap."""
    checkpoint = build_checkpoint("gemma2", tmp_path)
    assert checkpoint.hf_model.config.final_logit_softcapping == 3.0
    check_batch(make_llm(checkpoint.path, backend), checkpoint.hf_model, mixed_prompts(4))


def write_config(folder, config: transformers.PretrainedConfig, arch: str, drop: tuple[str, ...] = (),
                 **extra) -> str:
    """config.json as ``config`` writes it, less ``drop``, plus ``extra`` (a checkpoint's older keys)."""
    hf = {k: v for k, v in config.to_dict().items() if k not in drop} | extra | {"architectures": [arch]}
    (folder / "config.json").write_text(json.dumps(hf))
    return str(folder)


@pytest.mark.parametrize("family, layers, extra", [
    ("gemma2", 5, {}),
    ("gemma3", 8, {}),
    ("gemma3", 8, {"sliding_window_pattern": 3}),
])
def test_configs_without_layer_types_get_transformers_windows(tmp_path, family, layers, extra):
    cls = transformers.Gemma2Config if family == "gemma2" else transformers.Gemma3TextConfig
    arch = "Gemma2ForCausalLM" if family == "gemma2" else "Gemma3ForCausalLM"
    path = write_config(tmp_path, cls(**SMALL, num_hidden_layers=layers), arch, drop=("layer_types",), **extra)
    with open(f"{path}/config.json") as f:
        want = cls(**json.load(f)).layer_types  # transformers' reading of the same file
    windows = read_model_config(path).layer_windows
    assert windows == tuple(16 if kind == "sliding_attention" else 0 for kind in want)
    assert 0 in windows and 16 in windows


def test_gemma3_rope_tables_in_both_config_formats(tmp_path):
    """Global layers: rope_theta with linear scaling; local ones: rope_local_base_freq, as transformers reads them."""
    old_keys = dict(rope_theta=500_000.0, rope_local_base_freq=20_000.0, rope_scaling={"rope_type": "linear",
                                                                                        "factor": 8.0})
    config = transformers.Gemma3TextConfig(**SMALL, num_hidden_layers=6, **old_keys)  # layer 5 is global
    hf = Gemma3RotaryEmbedding(config)
    want = torch.stack([hf.full_attention_inv_freq, hf.sliding_attention_inv_freq])
    new_format = config.to_dict()
    legacy = {k: v for k, v in new_format.items() if k != "rope_parameters"} | old_keys
    for hf_dict in (new_format, legacy):
        ropes = Gemma3ForCausalLM.rope_configs(hf_dict, 64, config.max_position_embeddings)
        torch.testing.assert_close(torch.stack([rope_inv_freq(rope)[0] for rope in ropes]), want)


@pytest.mark.parametrize("extra, match", [
    ({"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_configs_the_engine_cannot_run_fail_at_load(tmp_path, extra, match):
    path = write_config(tmp_path, ARCH_CONFIGS["gemma2"](), "Gemma2ForCausalLM", **extra)
    with pytest.raises(ValueError, match=match):
        Gemma2ForCausalLM(read_model_config(path), torch.device("cpu"), torch.float32, TensorParallel())
