"""RoPE scalings against transformers (its ``ROPE_INIT_FUNCTIONS`` and its models' rotary modules), config parsing
of both rope formats and its errors, LongRoPE's per-sequence table choice, Phi-3's fused checkpoint tensors split
per rank, and Phi-3 past its original context."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from engine import LLM, SamplingParams
from engine.distributed.parallel_state import TensorParallel
from engine.layers.attention import AttentionMetadata
from engine.layers.linear import ColumnParallelLinear, Shard
from engine.layers.rotary import RopeConfig, RotaryEmbedding, rope_config, rope_inv_freq
from engine.models.llama import Phi3ForCausalLM
from .conftest import backends, build_checkpoint, hf_greedy, longrope_parameters

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
LLAMA_ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": LLAMA3,
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": YARN,
    "yarn-betas-untruncated": {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-mscale": {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5, "rope_theta": 500000.0},
    "yarn-partial-attention-factor": {**YARN, "attention_factor": 0.9, "partial_rotary_factor": 0.5},
}
PHI3_ROPES = {  # original context 1024 of 4096
    "longrope": longrope_parameters(64),
    "longrope-partial-factors": longrope_parameters(48, partial_rotary_factor=0.75, factor=2.0,
                                                    attention_factor=1.1),
}
MAX_POSITION = 4096


def hf_config(name: str) -> transformers.PretrainedConfig:
    if name in PHI3_ROPES:
        return transformers.Phi3Config(hidden_size=256, num_attention_heads=4, max_position_embeddings=MAX_POSITION,
                                       original_max_position_embeddings=1024, rope_parameters=PHI3_ROPES[name])
    return transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=MAX_POSITION,
                                    rope_parameters=LLAMA_ROPES[name])


def engine_rope(config: transformers.PretrainedConfig) -> RopeConfig:
    aliases = Phi3ForCausalLM.rope_aliases if config.model_type == "phi3" else None
    return rope_config(config.to_dict(), 64, config.max_position_embeddings, aliases)


@pytest.mark.parametrize("name", sorted(LLAMA_ROPES | PHI3_ROPES))
def test_inv_freq_matches_transformers(name):
    config = hf_config(name)
    rope = engine_rope(config)
    init = ROPE_INIT_FUNCTIONS.get(rope.rope_type)
    want = (init(config, "cpu") if init else
            (1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64)), 1.0))
    inv_freq, attention_factor = rope_inv_freq(rope)
    assert torch.equal(inv_freq, want[0]) and attention_factor == want[1]
    if rope.rope_type == "longrope":  # the long factors, as transformers picks them past the original context
        long, _ = init(config, "cpu", seq_len=1025)
        assert torch.equal(rope_inv_freq(rope, long=True)[0], long) and not torch.equal(long, want[0])
    if rope.rope_type == "dynamic":  # rescaled only past max_position_embeddings, where the engine never goes
        assert torch.equal(init(config, "cpu", seq_len=MAX_POSITION)[0], inv_freq)


@pytest.mark.parametrize("name", sorted(LLAMA_ROPES | PHI3_ROPES))
def test_tables_match_transformers_rotary_modules(name):
    """cos / sin as the model's own rotary module gives them (attention factor included), over every position;
    LongRoPE's short table for a sequence within the original context, its long one for one past it."""
    config = hf_config(name)
    rope = engine_rope(config)
    rotary = RotaryEmbedding(rope, torch.device("cpu"), torch.float32)
    hf_rotary = (Phi3RotaryEmbedding if name in PHI3_ROPES else LlamaRotaryEmbedding)(config)
    half = rope.rotary_dim // 2
    lengths = [1024, MAX_POSITION] if rope.rope_type == "longrope" else [MAX_POSITION]
    for table, length in enumerate(lengths):
        cos, sin = hf_rotary(torch.zeros(1), torch.arange(length)[None])
        rows = slice(table * MAX_POSITION, table * MAX_POSITION + length)
        assert torch.equal(rotary.cos[rows], cos[0, :, :half]) and torch.equal(rotary.sin[rows], sin[0, :, :half])
    assert rotary.cos.shape == (len(lengths) * MAX_POSITION, half)


def test_legacy_rope_config_keys():
    legacy = rope_config({"rope_theta": 500000.0, "rope_scaling": LLAMA3}, 64, 8192)
    assert (legacy.theta, legacy.rope_type, legacy.original_max_position) == (500000.0, "llama3", 1024)
    assert rope_config({}, 64, 2048) == RopeConfig(10000.0, 64, 2048, 2048)
    # Phi-3-mini-128k: "su" in rope_scaling, the original context and partial rotary factor at the top level.
    phi3 = rope_config({"rope_scaling": {"type": "su", **longrope_parameters(32)}, "partial_rotary_factor": 0.5,
                        "original_max_position_embeddings": 4096}, 64, 131072, Phi3ForCausalLM.rope_aliases)
    assert (phi3.rope_type, phi3.rotary_dim, phi3.original_max_position) == ("longrope", 32, 4096)


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "ntk-by-parts"}, "rope_scaling: unsupported rope_type 'ntk-by-parts'"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "rope_type 'yarn' requires the field 'factor'"),
    ({"type": "dynamic"}, "rope_type 'dynamic' requires the field 'factor'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 32}, "requires the field 'long_factor'"),
    ({**longrope_parameters(64), "short_factor": [1.0] * 31}, r"rope_scaling.short_factor: expected a list of 32"),
    ({"rope_type": "default", "partial_rotary_factor": 0.3}, "partial_rotary_factor=0.3 gives 19 rotary dims"),
])
def test_bad_rope_config_is_rejected(scaling, message):
    with pytest.raises(ValueError, match=message):
        rope_config({"rope_scaling": scaling}, 64, 256)


def test_bad_rope_config_fails_at_load(tmp_path, llama_checkpoint):
    folder = shutil.copytree(llama_checkpoint.path, tmp_path / "model")
    config_file = os.path.join(folder, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0}
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="rope_parameters: rope_type 'yarn' requires the field 'factor'"):
        LLM(str(folder), skip_tokenizer_init=True, dtype="float32", show_progress=False)


def test_longrope_rows_follow_each_sequence_length():
    """A token takes the long table when its own sequence, counting this step's tokens, is past the original
    context (8 here), whatever the other sequences of the batch are."""
    rope = RopeConfig(10000.0, 8, 16, 8, "longrope", {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    rotary = RotaryEmbedding(rope, torch.device("cpu"), torch.float32)
    # Decodes at positions 7 (length 8: short) and 8 (length 9: long), a prefill of 3 ending at length 10.
    meta = AttentionMetadata(torch.zeros(5, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int32),
                             torch.tensor([8, 9, 10], dtype=torch.int32), torch.tensor([0, 1, 2, 5], dtype=torch.int32),
                             3, 10)
    rows = rotary.step(torch.tensor([7, 8, 7, 8, 9]), meta).positions
    assert rows.tolist() == [7, 8 + 16, 7 + 16, 8 + 16, 9 + 16]


def test_fused_checkpoint_tensor_is_split_part_by_part():
    """A stored q|k|v on rank 1 of 2: its half of the query rows, the one (replicated) KV head's k and v rows."""
    qkv = ColumnParallelLinear(128, [256, 64, 64], False, TensorParallel(rank=1, size=2), [2, 1, 1])
    assert qkv.fused_checkpoint_shards("weight") == [Shard(0, 384, 128, 128, 0), Shard(0, 384, 256, 64, 128),
                                                      Shard(0, 384, 320, 64, 192)]
    one_part = ColumnParallelLinear(128, [256], False, TensorParallel())
    assert one_part.fused_checkpoint_shards("weight") is None


@pytest.mark.parametrize("backend", backends())
def test_phi3_past_original_context_matches_hf(tmp_path, backend):
    """One batch of sequences within the original context (128; 108 + 20 ends on it) and past it from the
    prompt on (long factors throughout); each matches transformers run on it alone (no chunking, no preemption).
    A sequence crossing the original context while it decodes differs: docs/engine.md."""
    checkpoint = build_checkpoint("phi3", tmp_path)
    prompts = [[(7 * i + 3 * j) % 299 + 1 for j in range(n)] for i, n in enumerate([20, 150, 108, 129, 60, 200])]
    llm = LLM(checkpoint.path, skip_tokenizer_init=True, dtype="float32", show_progress=False,
              attention_backend=backend, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(checkpoint.hf_model, p, 20) for p in prompts]
