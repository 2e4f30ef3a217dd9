"""bench_offline's llama.cpp peer: the GGUF it writes (read back with gguf's own reader), the rotary layout change
its converter makes, and, where llama-cpp-python is installed, llama.cpp's greedy tokens on that file against
pagedserve's on the checkpoint."""
from __future__ import annotations

import os

import pytest
import torch

from loadtest.llama_cpp_peer import gguf_name, interleave_rotary, write_gguf

from .conftest import build_checkpoint


def _rope_half(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate-half rotary on [heads, d] (pairs i, i + d/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()), -1)


def _rope_interleaved(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """llama.cpp's ``llama`` rotary on [heads, d] (pairs 2i, 2i + 1)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()
    return out


def test_interleaved_weights_rotate_to_the_same_attention_scores():
    """q.k after llama.cpp's rotary on the permuted weights equals q.k after HF's on the originals."""
    torch.manual_seed(0)
    heads, d, hidden = 3, 8, 16
    wq, wk = torch.randn(heads * d, hidden), torch.randn(heads * d, hidden)
    x, y = torch.randn(hidden), torch.randn(hidden)
    angles = 5 * torch.rand(d // 2)
    pairs = ((wq, x), (wk, y))
    hf_q, hf_k = (_rope_half((w @ v).view(heads, d), angles) for w, v in pairs)
    cpp_q, cpp_k = (_rope_interleaved((interleave_rotary(w, heads) @ v).view(heads, d), angles) for w, v in pairs)
    torch.testing.assert_close((cpp_q * cpp_k).sum(-1), (hf_q * hf_k).sum(-1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(interleave_rotary(wq, heads), wq)


def test_tensor_names_follow_llama_cpp():
    assert gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_name("model.layers.3.mlp.up_proj.weight") == "blk.3.ffn_up.weight"
    assert gguf_name("model.layers.0.self_attn.q_proj.bias") == "blk.0.attn_q.bias"
    assert gguf_name("lm_head.weight") == "output.weight"
    with pytest.raises(ValueError, match="no GGUF name"):
        gguf_name("model.layers.0.self_attn.rotary_emb.inv_freq")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_holds_every_tensor_and_the_hyperparameters(tmp_path, arch):
    gguf = pytest.importorskip("gguf")
    checkpoint = build_checkpoint(arch, tmp_path / "hf")
    path = write_gguf(checkpoint.path, str(tmp_path / "model.gguf"))
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    state = checkpoint.hf_model.state_dict()
    tied = "lm_head.weight" in state and checkpoint.hf_model.config.tie_word_embeddings
    assert set(tensors) == {gguf_name(n) for n in state if not (tied and n == "lm_head.weight")}
    config = checkpoint.hf_model.config
    field = reader.fields[f"{arch}.attention.head_count_kv"]
    assert field.parts[field.data[0]][0] == config.num_key_value_heads
    for name, value in state.items():
        if tied and name == "lm_head.weight":
            continue
        got = torch.from_numpy(tensors[gguf_name(name)].data.copy()).reshape(value.shape)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            value = interleave_rotary(value, heads)
        assert torch.equal(got, value.float()), name


def test_llama_cpp_greedy_tokens_match_pagedserve(tmp_path):
    """Same weights, same prompts: llama.cpp on the GGUF gives pagedserve's greedy tokens (fp32, peaked logits)."""
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from engine import LLM, SamplingParams
    from loadtest.llama_cpp_peer import LlamaCppPeer, LlamaCppSettings

    checkpoint = build_checkpoint("llama", tmp_path / "hf")
    prompts, lens = [[5, 6, 7, 8], [9, 10, 11], [12] * 20], [8, 8, 8]
    llm = LLM(checkpoint.path, skip_tokenizer_init=True, show_progress=False)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    want = [list(o.outputs[0].token_ids) for o in outs]
    peer = LlamaCppPeer(write_gguf(checkpoint.path, str(tmp_path / "model.gguf")))
    try:
        for unified in (True, False):  # a 16-token budget: the long prompt goes in chunks beside decodes
            _, got = peer.run(prompts, lens, LlamaCppSettings(threads=1, flash_attn=False, kv_unified=unified,
                                                              n_batch=16))
            assert got == want
    finally:
        peer.close()


def test_llama_cpp_quantizes_its_own_q8_0_and_q4_k_m(tmp_path):
    """bench_offline's llama.cpp at its best also tries llama.cpp's own quantizations: each file holds its format
    (Q8_0 blocks; Q4_K_M's 4-bit types, or its per-tensor fallback where a row is no multiple of 256), and each
    decodes the batch."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from loadtest.llama_cpp_peer import LlamaCppPeer, LlamaCppSettings, write_ggufs

    checkpoint = build_checkpoint("llama", tmp_path / "hf")
    files = write_ggufs(checkpoint.path, str(tmp_path), ["f", "q8_0", "q4_k_m"], threads=1)
    types = {w: {t.tensor_type for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1 and "blk." in t.name}
             for w, path in files.items()}
    Q = gguf.GGMLQuantizationType
    assert types["f"] == {Q.F32} and types["q8_0"] == {Q.Q8_0}
    assert types["q4_k_m"] and types["q4_k_m"].isdisjoint({Q.F32, Q.F16, Q.BF16})
    assert os.path.getsize(files["q4_k_m"]) < os.path.getsize(files["q8_0"]) < os.path.getsize(files["f"])
    peer = LlamaCppPeer(files)
    try:
        for weights in files:
            _, got = peer.run([[5, 6, 7, 8], [9, 10, 11]], [6, 6], LlamaCppSettings(1, False, weights=weights))
            assert [len(g) for g in got] == [6, 6] and all(0 <= t < 1000 for g in got for t in g)
    finally:
        peer.close()
