"""The int8-weight skinny GEMMs (pack_linear_weight of int8 + skinny_linear_w8; pack_linear_weight_w8a8 +
skinny_linear_w8a8, x quantized per row; CPU) against the dequantised weight's matmul in fp32 and the reference."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference
from engine.quantization import dequantize, quantize
from .test_skinny_gemm import relative_error, torch_threads


def int8_layer(rows: int, in_features: int, out_features: int, seed: int, dtype: torch.dtype = torch.float32):
    """(x, q, scale [out], bias, the dequantised weight in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    q, scale = quantize(torch.randn(out_features, in_features, generator=gen), "int8")
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    return x, q, scale.view(-1), bias, dequantize(q, scale, torch.float32)


def expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ weight.t()
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 13, 31, 64, 65])
@pytest.mark.parametrize("in_features, out_features", [(256, 512), (37, 100), (896, 1152), (1, 17), (129, 1000)])
def test_fp32_matches_dequantised_matmul(ext_ops, rows, in_features, out_features):
    x, q, scale, bias, weight = int8_layer(rows, in_features, out_features, rows + out_features)
    packed = torch.ops.pagedserve.pack_linear_weight(q)
    for b in (None, bias):
        y = torch.ops.pagedserve.skinny_linear_w8(x, packed, scale, b, out_features)
        assert y.dtype == torch.float32 and y.shape == (rows, out_features)
        assert relative_error(y, expected(x, weight, b)) <= 1e-5


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 896, 4864), (4, 4864, 896), (17, 129, 1000)])
def test_bf16_activations_round_once(ext_ops, threads, rows, in_features, out_features):
    """bf16 x: fp32 sums of the exact bf16 inputs, rounded to bf16 once (within one bf16 ulp of fp32 math)."""
    x, q, scale, bias, weight = int8_layer(rows, in_features, out_features, rows, torch.bfloat16)
    with torch_threads(threads):
        y = cuda_ext.pack_linear(q, bias, scale=scale)(x)
    assert y.dtype == torch.bfloat16
    exact = expected(x, weight, bias)
    assert ((y.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()


def test_packed_layout_and_reference(ext_ops):
    x, q, scale, bias, weight = int8_layer(9, 70, 200, 3)
    packed = torch.ops.pagedserve.pack_linear_weight(q)
    assert packed.dtype == torch.int8
    assert torch.equal(packed, reference.pack_linear_weight(q, panel=packed.shape[2]))
    assert relative_error(reference.skinny_linear_w8(x, packed, scale, bias, 200), expected(x, weight, bias)) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 256, 32000), (7, 37, 100), (65, 64, 17)])
def test_fused_argmax(ext_ops, dtype, rows, in_features, out_features):
    """The logits in fp32 (a bf16 layer's rounded values, as its own output gives them) and their argmax."""
    x, q, scale, bias, _ = int8_layer(rows, in_features, out_features, rows, dtype)
    packed = cuda_ext.pack_linear(q, bias, scale=scale)
    logits, idx = packed.with_argmax(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, packed(x).float())
    assert torch.equal(idx, logits.argmax(-1)) and torch.equal(packed.argmax(x), idx)


def test_leading_dims_and_zero_rows(ext_ops):
    x, q, scale, bias, weight = int8_layer(6, 64, 80, 4)
    packed = cuda_ext.pack_linear(q, bias, scale=scale)
    assert packed(torch.empty(0, 64)).shape == (0, 80)
    y = packed(x.view(2, 3, 64))
    assert y.shape == (2, 3, 80) and relative_error(y.view(6, 80), expected(x, weight, bias)) <= 1e-5


def test_rejects_bad_inputs(ext_ops):
    x, q, scale, bias, _ = int8_layer(2, 64, 80, 5)
    packed = torch.ops.pagedserve.pack_linear_weight(q)
    w8 = torch.ops.pagedserve.skinny_linear_w8
    with pytest.raises(RuntimeError, match="scale must be contiguous fp32"):
        w8(x, packed, scale.double(), None, 80)
    with pytest.raises(RuntimeError, match="scale must be contiguous fp32"):
        w8(x, packed, scale[:40], None, 80)
    with pytest.raises(RuntimeError, match="does not fit"):
        w8(x[:, :32], packed, scale, None, 80)
    with pytest.raises(RuntimeError, match="does not fit"):  # a float panel is no int8 one
        w8(x, torch.ops.pagedserve.pack_linear_weight(q.float()), scale, None, 80)
    with pytest.raises(RuntimeError, match="bias must be contiguous"):
        w8(x, packed, scale, bias.bfloat16(), 80)


w8a8 = pytest.mark.skipif("not torch.ops.pagedserve.skinny_linear_w8a8_supports()",
                         reason="this build has no W8A8 GEMM (CPU without AVX512-VNNI)")


@w8a8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 48, 49, 64])
@pytest.mark.parametrize("in_features, out_features", [(896, 1152), (37, 100), (1, 17), (130, 1000)])
def test_w8a8_matches_reference(ext_ops, dtype, rows, in_features, out_features):
    """The integer sums are exact: the op equals the reference (x quantized alike, float64 sums) to fp32 rounding
    of the epilogue (bf16: one bf16 rounding), and the fp32 matmul within the activations' quantization error."""
    x, q, scale, bias, weight = int8_layer(rows, in_features, out_features, rows + in_features, dtype)
    packed, col_offset = torch.ops.pagedserve.pack_linear_weight_w8a8(q)
    ref_packed, ref_offset = reference.pack_linear_weight_w8a8(q, panel=packed.shape[2] // 4)
    assert torch.equal(packed, ref_packed) and torch.equal(col_offset, ref_offset)
    for b in (None, bias):
        y = torch.ops.pagedserve.skinny_linear_w8a8(x, packed, scale, col_offset, b, out_features)
        ref = reference.skinny_linear_w8a8(x.float(), packed, scale, col_offset, None if b is None else b.float(),
                                           out_features)
        assert y.dtype == dtype and y.shape == (rows, out_features)
        tolerance = 2 ** -8 if dtype == torch.bfloat16 else 1e-6
        assert ((y.float() - ref).abs() <= ref.abs() * tolerance + 1e-4).all()
        assert relative_error(y, expected(x, weight, b)) <= 0.02  # measured ~0.006


@w8a8
def test_w8a8_zero_and_outlier_rows(ext_ops):
    """A zero row gives the bias exactly; an outlier in one row costs that row alone its resolution."""
    x, q, scale, bias, weight = int8_layer(3, 256, 80, 7)
    x[0] = 0
    x[1, 5] = 1e4
    packed = cuda_ext.pack_linear(q, bias, scale=scale, quantize_activations=True)
    assert packed.col_offset is not None
    y = packed(x)
    assert torch.equal(y[0], bias)
    assert relative_error(y[2:], expected(x[2:], weight, bias)) <= 0.02


@w8a8
@pytest.mark.parametrize("threads", [1, 2])
def test_w8a8_threads_agree(ext_ops, threads):
    x, q, scale, bias, _ = int8_layer(13, 512, 2000, 11, torch.bfloat16)
    packed = cuda_ext.pack_linear(q, bias, scale=scale, quantize_activations=True)
    with torch_threads(threads):
        y = packed(x)
    with torch_threads(1):
        assert torch.equal(y, packed(x))


@w8a8
def test_w8a8_rejects_bad_inputs(ext_ops):
    x, q, scale, bias, _ = int8_layer(2, 64, 80, 5)
    packed, col_offset = torch.ops.pagedserve.pack_linear_weight_w8a8(q)
    op = torch.ops.pagedserve.skinny_linear_w8a8
    with pytest.raises(RuntimeError, match="does not fit"):  # the W8A16 layout is no W8A8 one
        op(x, torch.ops.pagedserve.pack_linear_weight(q), scale, col_offset, None, 80)
    with pytest.raises(RuntimeError, match="does not fit"):
        op(x[:, :32], packed, scale, col_offset, None, 80)
    with pytest.raises(RuntimeError, match="col_offset must be"):
        op(x, packed, scale, col_offset[:40], None, 80)
    with pytest.raises(RuntimeError, match="scale must be contiguous fp32"):
        op(x, packed, scale.double(), col_offset, None, 80)
    with pytest.raises(RuntimeError, match="weight must be int8"):
        torch.ops.pagedserve.pack_linear_weight_w8a8(q.float())
