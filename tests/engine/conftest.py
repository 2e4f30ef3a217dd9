"""Tiny random-weight Hugging Face checkpoints, built once per session, and HF reference outputs."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
import transformers

# The engine's device in the exactness tests (loadtest/gpu_check.sh sets cuda); the HF reference stays on CPU.
TEST_DEVICE = os.environ.get("PAGEDSERVE_TEST_DEVICE", "cpu")
VOCAB = 300
MAX_NEW_TOKENS = 20
# head_dim 64, one of the compiled attention kernels' head sizes (cuda_ext.HEAD_SIZES).
COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
              max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0,
              # Wider than HF's 0.02 default so logits are peaked and fp32 argmax ties are unlikely.
              initializer_range=0.3)

def longrope_parameters(rotary_dim: int, **extra) -> dict:
    """LongRoPE with distinct short and long factors per rotary dim pair (the long ones stretch further)."""
    half = rotary_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / half for i in range(half)],
            "long_factor": [1.0 + 8.0 * i / half for i in range(half)], **extra}


# The hybrid (linear-attention) families' shared shape.
_HYBRID = dict(num_key_value_heads=1, head_dim=64, intermediate_size=256, tie_word_embeddings=False,
               layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=4)

ARCH_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=1, intermediate_size=256,
                                              rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=1, intermediate_size=256,
                                              tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**{**COMMON, "num_attention_heads": 4}, num_key_value_heads=2,
                                              intermediate_size=256, head_dim=64,
                                              tie_word_embeddings=False),
    # Windows shorter than the prompts (up to 70 tokens + 20 new) and than a block: Mistral's on every layer,
    # Qwen2's from max_window_layers on.
    "mistral-window": lambda: transformers.MistralConfig(**COMMON, num_key_value_heads=1, intermediate_size=256,
                                                         sliding_window=12, tie_word_embeddings=False),
    "qwen2-window": lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=1, intermediate_size=256,
                                                     use_sliding_window=True, sliding_window=24, max_window_layers=1,
                                                     tie_word_embeddings=True),
    # Gemma 2: local (window 16) / global layers, attention and final logit soft-capping, a query_pre_attn_scalar
    # other than head_dim. Untied: tied random embeddings scaled by sqrt(hidden) only ever repeat the last token.
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, num_key_value_heads=1, head_dim=64, intermediate_size=256,
                                                sliding_window=16, attn_logit_softcapping=5.0,
                                                final_logit_softcapping=3.0, query_pre_attn_scalar=48,
                                                tie_word_embeddings=False),
    # Gemma 3: q/k norms, 5 local (window 20) : 1 global layer, the local RoPE base, linear scaling on the global.
    "gemma3": lambda: transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, num_key_value_heads=1,
                                                    head_dim=64, intermediate_size=256, sliding_window=20,
                                                    rope_scaling={"rope_type": "linear", "factor": 8.0},
                                                    tie_word_embeddings=False),
    # Gemma 4: local (window 16) / global layers, the global ones with their own head size (128), KV heads (2) and
    # proportional RoPE, their values the keys' projection (attention_k_eq_v); per-layer input embeddings; the last
    # two layers read layers 2 and 3's K/V (num_kv_shared_layers) and have double-wide MLPs.
    "gemma4": lambda: transformers.Gemma4TextConfig(
        **{**COMMON, "num_hidden_layers": 6}, num_key_value_heads=1, head_dim=64, global_head_dim=128,
        num_global_key_value_heads=2, attention_k_eq_v=True, intermediate_size=256, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=2, use_double_wide_mlp=True,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, final_logit_softcapping=10.0,
        tie_word_embeddings=False),
    # Gemma 4's MoE (26B-A4B's shape): every layer's dense MLP beside 8 GELU-tanh experts, top-2, routed from the
    # residual stream; no per-layer inputs, no KV sharing.
    "gemma4-moe": lambda: transformers.Gemma4TextConfig(
        **{**COMMON, "num_hidden_layers": 4}, num_key_value_heads=1, head_dim=64, global_head_dim=128,
        num_global_key_value_heads=2, attention_k_eq_v=True, intermediate_size=128, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
        final_logit_softcapping=10.0, tie_word_embeddings=False),
    # YaRN past its original context of 64: the scaling is static, so the engine is exact at every length.
    "llama-yarn": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=1, intermediate_size=256,
                                                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                                    "factor": 4.0,
                                                                    "original_max_position_embeddings": 64},
                                                   tie_word_embeddings=False),
    # Phi-3: q|k|v and gate|up stored fused, LongRoPE (prompts stay within the original context of 128: short
    # factors; test_longrope.py goes past it), a sliding window as Phi-3-mini-4k has.
    "phi3": lambda: transformers.Phi3Config(**COMMON, num_key_value_heads=1, intermediate_size=256,
                                            original_max_position_embeddings=128, sliding_window=48,
                                            rope_parameters=longrope_parameters(64), tie_word_embeddings=False),
    # Phi-4-mini's shape: three quarters of each head rotate, tied embeddings.
    "phi4-mini": lambda: transformers.Phi3Config(**COMMON, num_key_value_heads=1, intermediate_size=256,
                                                 original_max_position_embeddings=128,
                                                 rope_parameters=longrope_parameters(48, partial_rotary_factor=0.75),
                                                 tie_word_embeddings=True),
    # MoE: 8 experts per sparse layer, their routers random so tokens spread over all of them. Mixtral: top-2
    # renormalised, a sliding window on every layer.
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_key_value_heads=1, intermediate_size=64,
                                                  num_local_experts=8, num_experts_per_tok=2, sliding_window=12,
                                                  tie_word_embeddings=False),
    # Qwen2-MoE: top-2 not renormalised (norm_topk_prob false, as its checkpoints), a sigmoid-gated shared expert.
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(**COMMON, num_key_value_heads=1, intermediate_size=256,
                                                     moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                                     num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                                     tie_word_embeddings=False),
    # Qwen3-MoE: top-4 renormalised, q/k norms, layer 0 dense (mlp_only_layers).
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**{**COMMON, "num_attention_heads": 4}, num_key_value_heads=2,
                                                     head_dim=64, intermediate_size=256, moe_intermediate_size=64,
                                                     num_experts=8, num_experts_per_tok=4, norm_topk_prob=True,
                                                     mlp_only_layers=[0], tie_word_embeddings=False),
    # gpt-oss: sliding (window 12) / full layers, attention sinks, biases everywhere, YaRN as its checkpoints
    # (untruncated, past an original context of 64), 8 experts top-2 through the clamped SwiGLU.
    "gpt-oss": lambda: transformers.GptOssConfig(**COMMON, num_key_value_heads=1, head_dim=64, intermediate_size=64,
                                                 num_local_experts=8, num_experts_per_tok=2, sliding_window=12,
                                                 rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                                                  "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                                  "truncate": False,
                                                                  "original_max_position_embeddings": 64},
                                                 tie_word_embeddings=False),
    # DeepSeek-V3: MLA with a low-rank query (q_lora_rank), a 48-dim latent + 16 interleaved rope dims (one 64-wide
    # cached "head"), YaRN with mscale != mscale_all_dim (rotary and softmax scale both change); layer 0 dense, then
    # 8 experts in 4 groups, the best 2 groups kept, top-2, a selection bias, a shared expert, scaled weights.
    "deepseek-v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_attention_heads": 4}, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=8,
        n_shared_experts=1, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 64, "mscale": 1.0,
                                                    "mscale_all_dim": 0.8},
        tie_word_embeddings=False),
    # Qwen3-Next: Gated DeltaNet layers (2 key heads, each serving 2 value heads) around one gated full-attention
    # layer (partial RoPE); layer 0's MLP dense, the others 8 experts top-2 renormalised with a shared expert.
    "qwen3-next": lambda: transformers.Qwen3NextConfig(**{**COMMON, "num_hidden_layers": 3}, **_HYBRID,
                                                       moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                                       mlp_only_layers=[0]),
    # Qwen3.5 (dense text): the same layers with the linear projections stored apart.
    "qwen3.5": lambda: transformers.Qwen3_5TextConfig(**{**COMMON, "num_hidden_layers": 3}, **_HYBRID),
    # Qwen3.5-MoE: every layer sparse, top-2 always renormalised, a shared expert.
    "qwen3.5-moe": lambda: transformers.Qwen3_5MoeTextConfig(**{**COMMON, "num_hidden_layers": 3}, **_HYBRID,
                                                             moe_intermediate_size=64, num_experts=8,
                                                             num_experts_per_tok=2,
                                                             shared_expert_intermediate_size=96),
    "opt": lambda: transformers.OPTConfig(**COMMON, ffn_dim=256, word_embed_proj_dim=128, init_std=0.3),
    # opt-350m's shape: post-norm layers and projected embeddings.
    "opt-postnorm": lambda: transformers.OPTConfig(**COMMON, ffn_dim=256, word_embed_proj_dim=64, init_std=0.3,
                                                   do_layer_norm_before=False),
}


@dataclass
class Checkpoint:
    path: str
    hf_model: transformers.PreTrainedModel


def build_checkpoint(arch: str, folder, shard: bool = False, config: transformers.PretrainedConfig | None = None
                     ) -> Checkpoint:
    """``arch``'s checkpoint from ARCH_CONFIGS, or one of ``config`` when given."""
    torch.manual_seed(0)
    config = config or ARCH_CONFIGS[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    _draw_zero_norms(model)
    _draw_zero_biases(model)
    # Sharded for one family so multi-file loading is covered.
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB" if shard else "1GB")
    return Checkpoint(str(folder), model)


@torch.no_grad()
def _draw_zero_norms(model: transformers.PreTrainedModel) -> None:
    """Gemma's norms scale by 1 + weight, initialised to 0, Gemma 4's by weight and a per-layer scalar (its
    router by a scale and per-expert scales), initialised to 1: drawn at random instead (around that start), so
    their weights count."""
    start = 1.0 if model.config.model_type == "gemma4_text" else 0.0
    for name, param in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")) and not (
                param - start).any():
            param.normal_(start, 0.5)


@torch.no_grad()
def _draw_zero_biases(model: transformers.PreTrainedModel) -> None:
    """gpt-oss's biases (projections, experts) and DeepSeek's routing bias start at zero: drawn at random, so they
    count."""
    if model.config.model_type in ("gpt_oss", "deepseek_v3"):
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("bias") and not param.any():
                param.normal_(0.0, 0.5)


@pytest.fixture(scope="session", params=sorted(ARCH_CONFIGS))
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param), shard=request.param == "llama")


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory) -> Checkpoint:
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama-single"))


def mixed_prompts(count: int = 16, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (1..70 tokens); half share a 40-token prefix so prefix caching has something to hit."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(40)]
    prompts = []
    for i in range(count):
        own = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))]
        prompts.append(shared + own if i % 2 else own + [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 40))])
    return prompts


@torch.inference_mode()
def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """Reference: HF generate on one unpadded prompt at a time."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def hf_reference(checkpoint) -> list[list[int]]:
    return [hf_greedy(checkpoint.hf_model, p, MAX_NEW_TOKENS) for p in mixed_prompts()]


def backends() -> list:
    """The reference backend always; the compiled one when its build works here."""
    return ["torch", pytest.param("ext", marks=pytest.mark.skipif(not _ext_available(), reason="ext ops do not build"))]


_EXT_OK: list[bool] = []


def _ext_available() -> bool:
    if not _EXT_OK:
        try:
            import cuda_ext
            cuda_ext.load_ops("ext")
            _EXT_OK.append(True)
        except Exception:  # no compiler or a build error: the "torch" runs still cover the engine
            _EXT_OK.append(False)
    return _EXT_OK[0]
