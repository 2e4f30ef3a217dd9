"""The load's packing of linear layers, and the packed LM head's logits and argmax."""
from __future__ import annotations

import pytest
import torch

import cuda_ext


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_load_packs_linears_and_releases_unpacked_weights(tmp_path, arch):
    from engine.layers.linear import Linear
    from engine.layers.norm import RMSNorm
    from engine.loader import load_model
    from engine.models.config import read_model_config

    from .conftest import build_checkpoint

    checkpoint = build_checkpoint(arch, tmp_path)
    ops = cuda_ext.load_ops("ext")
    model = load_model(read_model_config(checkpoint.path), torch.device("cpu"), torch.float32, ops, False)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (arch == "qwen2")
    for m in linears:  # released, shape kept; a tied LM head keeps the embedding's
        assert m.weight.shape == (m.out_features, m.in_features)
        assert m.weight.device.type == ("cpu" if m is model.lm_head and tied else "meta")
    assert all(m.ops == ops for m in model.modules() if isinstance(m, RMSNorm))
    # The packed layers compute what the checkpoint's weights do.
    x = torch.randn(3, model.lm_head.in_features)
    hf_head = checkpoint.hf_model.lm_head.weight
    torch.testing.assert_close(model.lm_head(x), x @ hf_head.t(), rtol=1e-5, atol=1e-5)


def test_fp32_lm_head_gives_the_argmax_alone_when_asked(tmp_path):
    """``need_logits=False``: a packed fp32 LM head answers with its screened argmax and no logits, the same
    tokens as the fused argmax; the reference backend (no packing) still gives logits."""
    from engine.loader import load_model
    from engine.models.config import read_model_config

    from .conftest import build_checkpoint

    checkpoint = build_checkpoint("llama", tmp_path)
    config = read_model_config(checkpoint.path)
    model = load_model(config, torch.device("cpu"), torch.float32, cuda_ext.load_ops("ext"), False)
    hidden = torch.randn(6, model.lm_head.in_features)
    logits, argmax = model.compute_logits(hidden)
    alone, only_argmax = model.compute_logits(hidden, need_logits=False)
    assert alone is None and torch.equal(only_argmax, argmax) and torch.equal(argmax, logits.argmax(-1))
    assert (model.lm_head.packed.screen is not None) == torch.ops.pagedserve.argmax_screen_supports(torch.float32)
    plain = load_model(config, torch.device("cpu"), torch.float32, cuda_ext.load_ops("torch"), False)
    logits, argmax = plain.compute_logits(hidden, need_logits=False)
    assert argmax is None and logits.shape == (6, config.vocab_size)


def test_bf16_tied_lm_head_gives_fp32_logits_and_their_argmax(tmp_path):
    """A packed bf16 LM head (tied to the embedding, as in Qwen2) returns its bf16 logits widened to fp32 and
    their argmax, from one GEMM: what ``.float()`` and torch.argmax of the plain layer's output give."""
    from engine.loader import load_model
    from engine.models.config import read_model_config

    from .conftest import build_checkpoint

    if not torch.ops.pagedserve.skinny_linear_supports(torch.bfloat16):
        pytest.skip("bf16 layers stay on F.linear here (no AVX512-BF16)")
    checkpoint = build_checkpoint("qwen2", tmp_path)
    model = load_model(read_model_config(checkpoint.path), torch.device("cpu"), torch.bfloat16,
                       cuda_ext.load_ops("ext"), False)
    assert model.lm_head.packed is not None and model.lm_head.weight is model.model.embed_tokens.weight
    hidden = torch.randn(5, model.lm_head.in_features).bfloat16()
    logits, argmax = model.compute_logits(hidden)
    plain = model.lm_head(hidden)
    assert plain.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.equal(logits, plain.float()) and torch.equal(argmax, plain.argmax(-1))
    for rows in (2, 5):  # the argmax alone: screened (int8) up to 4 rows where the CPU has it, the same tokens
        alone, only_argmax = model.compute_logits(hidden[:rows], need_logits=False)
        assert alone is None and torch.equal(only_argmax, argmax[:rows])
    hf_logits = checkpoint.hf_model.lm_head.to(torch.bfloat16)(hidden)  # oneDNN's GEMM: rounding may differ
    torch.testing.assert_close(logits, hf_logits.float(), rtol=2 ** -7, atol=2 ** -7)
