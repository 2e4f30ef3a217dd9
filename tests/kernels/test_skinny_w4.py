"""The 4-bit skinny GEMM (pack_linear_weight_w4 + skinny_linear_w4, CPU) against the pure-torch reference
(reference.skinny_linear_w4: the dequantized weight's matmul in fp32)."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference
from .test_skinny_gemm import relative_error, torch_threads


def w4_layer(rows: int, in_features: int, out_features: int, group: int, symmetric: bool, seed: int,
             dtype: torch.dtype = torch.float32):
    """(x, codes, scale [out, groups], zero or None, bias), random."""
    gen = torch.Generator().manual_seed(seed)
    groups = in_features // group
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    scale = torch.rand(out_features, groups, generator=gen) * 0.1 + 0.01
    zero = None if symmetric else torch.randint(0, 16, (out_features, groups), generator=gen, dtype=torch.uint8)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    return x, codes, scale, zero, bias


@pytest.fixture(autouse=True)
def needs_w4(ext_ops):
    if not torch.ops.pagedserve.skinny_linear_w4_supports():
        pytest.skip("no AVX-512 in this build")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("in_features, out_features, group", [(128, 64, 32), (896, 1000, 128), (256, 17, 64),
                                                              (4864, 896, 128)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_fp32_matches_reference(rows, in_features, out_features, group, symmetric):
    x, codes, scale, zero, bias = w4_layer(rows, in_features, out_features, group, symmetric, rows + out_features)
    packed = torch.ops.pagedserve.pack_linear_weight_w4(codes, scale, zero)
    for b in (None, bias):
        y = torch.ops.pagedserve.skinny_linear_w4(x, *packed, b, out_features)
        assert y.dtype == torch.float32 and y.shape == (rows, out_features)
        assert relative_error(y, reference.skinny_linear_w4(x, codes, scale, zero, b)) <= 1e-5


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 896, 4864), (4, 4864, 896), (7, 128, 1000)])
def test_bf16_activations_round_once(threads, rows, in_features, out_features):
    """bf16 x: exact products of bf16 x and the codes summed in fp32, rounded to bf16 once."""
    x, codes, scale, zero, bias = w4_layer(rows, in_features, out_features, 64, False, rows, torch.bfloat16)
    with torch_threads(threads):
        y = cuda_ext.pack_linear(codes, bias, scale=scale, zero=zero)(x)
    assert y.dtype == torch.bfloat16
    exact = reference.skinny_linear_w4(x.float(), codes, scale, zero, bias.float())
    assert ((y.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3 * exact.abs().max()).all()


def test_fused_argmax_is_the_logits_argmax():
    x, codes, scale, zero, bias = w4_layer(3, 256, 700, 32, True, 7)
    layer = cuda_ext.pack_linear(codes, bias, scale=scale, zero=zero)
    logits, idx = layer.with_argmax(x)
    assert torch.equal(idx, logits.argmax(-1)) and torch.equal(layer.argmax(x), idx)


def test_bad_operands():
    x, codes, scale, zero, bias = w4_layer(1, 128, 64, 32, True, 0)
    with pytest.raises(RuntimeError, match="groups must split 128 input columns"):
        torch.ops.pagedserve.pack_linear_weight_w4(codes, torch.ones(64, 3), None)
    packed = torch.ops.pagedserve.pack_linear_weight_w4(codes, scale, zero)
    with pytest.raises(RuntimeError, match="does not fit x"):
        torch.ops.pagedserve.skinny_linear_w4(x[:, :64], *packed, None, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_reference(dtype):
    """The CUDA twin (cuda/w4_kernels.cu) on the same host-packed layout."""
    x, codes, scale, zero, bias = w4_layer(5, 896, 1000, 64, False, 3, dtype)
    layer = cuda_ext.pack_linear(codes.cuda(), bias.cuda(), scale=scale.cuda(), zero=zero.cuda())
    y = layer(x.cuda()).cpu()
    exact = reference.skinny_linear_w4(x.float(), codes, scale, zero, bias.float())
    assert y.dtype == dtype
    assert ((y.float() - exact).abs() <= exact.abs() * 2 ** -7 + 1e-3 * exact.abs().max()).all()
