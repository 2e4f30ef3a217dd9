"""The skinny GEMM (pack_linear_weight + skinny_linear, CPU) against torch.matmul and the reference."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import cuda_ext
from cuda_ext import reference


def relative_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return ((y - expected).abs().max() / expected.abs().max()).item()


def random_layer(rows: int, in_features: int, out_features: int, seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    return x, weight, torch.randn(out_features, generator=gen) if bias else None


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 18, 31, 64, 65, 300])
@pytest.mark.parametrize("in_features, out_features", [(256, 512), (37, 100), (688, 256), (1, 17), (129, 1000)])
def test_matches_matmul(ext_ops, rows, in_features, out_features):
    x, weight, _ = random_layer(rows, in_features, out_features, rows + out_features, bias=False)
    y = torch.ops.pagedserve.skinny_linear(x, torch.ops.pagedserve.pack_linear_weight(weight), None, out_features)
    assert y.shape == (rows, out_features)
    assert relative_error(y, torch.matmul(x, weight.t())) <= 1e-5


@pytest.mark.parametrize("threads", [1, 2])
def test_bias_strided_rows_and_threads(ext_ops, threads):
    with torch_threads(threads):
        x, weight, bias = random_layer(40, 512, 32000 + 5, 7, bias=True)
        rows = torch.cat([x, x], dim=1)[:, 512:]  # row stride 1024, dense last dim
        packed = cuda_ext.pack_linear(weight, bias)
        assert relative_error(packed(rows), torch.nn.functional.linear(rows, weight, bias)) <= 1e-5


def test_packed_layout_matches_reference(ext_ops):
    _, weight, bias = random_layer(1, 70, 200, 3, bias=True)
    packed = torch.ops.pagedserve.pack_linear_weight(weight)
    assert torch.equal(packed, reference.pack_linear_weight(weight, panel=packed.shape[2]))
    x = torch.randn(9, 70)
    expected = x @ weight.t() + bias
    assert relative_error(reference.skinny_linear(x, packed, bias, 200), expected) <= 1e-6
    assert relative_error(torch.ops.pagedserve.skinny_linear(x, packed, bias, 200), expected) <= 1e-5


def test_zero_rows_and_leading_dims(ext_ops):
    _, weight, bias = random_layer(1, 64, 80, 4, bias=True)
    packed = cuda_ext.pack_linear(weight, bias)
    assert packed(torch.empty(0, 64)).shape == (0, 80)
    x = torch.randn(2, 3, 64)
    assert relative_error(packed(x), torch.nn.functional.linear(x, weight, bias)) <= 1e-5


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 256, 32000), (7, 37, 100), (64, 256, 2000),
                                                            (13, 129, 1000), (65, 64, 17), (300, 64, 130)])
def test_fused_argmax_is_torch_argmax(ext_ops, threads, rows, in_features, out_features):
    x, weight, bias = random_layer(rows, in_features, out_features, rows, bias=True)
    packed = torch.ops.pagedserve.pack_linear_weight(weight)
    with torch_threads(threads):
        for b in (None, bias):
            y, idx = torch.ops.pagedserve.skinny_linear_argmax(x, packed, b, out_features)
            assert torch.equal(y, torch.ops.pagedserve.skinny_linear(x, packed, b, out_features))
            assert torch.equal(idx, y.argmax(-1))
            ref_y, ref_idx = reference.skinny_linear_argmax(x, packed, b, out_features)
            assert relative_error(y, ref_y) <= 1e-5 and torch.equal(ref_idx, ref_y.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_argmax_ties_nan_and_inf(ext_ops, dtype):
    """The first maximum wins, in any panel or lane; a NaN counts as the maximum (the first one); -inf rows."""
    skip_without_bf16(dtype)
    x, weight, _ = random_layer(5, 64, 200, 11, bias=False)
    weight[150], weight[199], weight[67] = weight[3], weight[3], weight[3]  # ties across panels and lanes
    x, weight = x.to(dtype), weight.to(dtype)
    packed = torch.ops.pagedserve.pack_linear_weight(weight)
    ninf = torch.full((200,), float("-inf"))
    biases = [None, torch.zeros(200).index_fill_(0, torch.tensor([70, 190]), float("nan")),
              ninf, ninf.clone().index_fill_(0, torch.tensor([199]), 1.0)]
    for bias in biases:
        bias = None if bias is None else bias.to(dtype)
        y, idx = torch.ops.pagedserve.skinny_linear_argmax(x, packed, bias, 200)
        assert torch.equal(idx, y.argmax(-1))
    assert idx.tolist() == [199] * 5


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 896, 5000), (16, 64, 2000), (7, 37, 100),
                                                            (65, 64, 17), (6, 129, 1000)])
def test_bf16_fused_argmax_is_argmax_of_bf16_logits(ext_ops, threads, rows, in_features, out_features):
    """A bf16 layer's fused logits are its bf16 output widened to fp32 (what the model's ``.float()`` gives),
    and the argmax is torch.argmax over them (bf16 rounding makes ties common: the first one wins)."""
    skip_without_bf16(torch.bfloat16)
    x, weight, bias = (t.bfloat16() for t in random_layer(rows, in_features, out_features, rows, bias=True))
    weight[out_features - 1] = weight[out_features // 2]  # an exact tie, late in the row
    packed = torch.ops.pagedserve.pack_linear_weight(weight)
    with torch_threads(threads):
        for b in (None, bias):
            y, idx = torch.ops.pagedserve.skinny_linear_argmax(x, packed, b, out_features)
            logits = torch.ops.pagedserve.skinny_linear(x, packed, b, out_features)
            assert y.dtype == torch.float32 and torch.equal(y, logits.float())
            assert torch.equal(idx, logits.argmax(-1))
            ref_y, ref_idx = reference.skinny_linear_argmax(x, packed, b, out_features)
            assert ref_y.dtype == torch.float32 and torch.equal(ref_idx, ref_y.argmax(-1))


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def skip_without_bf16(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not torch.ops.pagedserve.skinny_linear_supports(torch.bfloat16):
        pytest.skip("this build has no bf16 skinny GEMM (CPU without AVX512-BF16)")


@pytest.mark.parametrize("rows", [1, 5, 6, 18, 64, 130])
@pytest.mark.parametrize("in_features, out_features", [(256, 512), (37, 100), (896, 4864), (1, 17), (129, 200)])
def test_bf16_matches_fp32_math(ext_ops, rows, in_features, out_features):
    skip_without_bf16(torch.bfloat16)
    x, weight, bias = (t.bfloat16() for t in random_layer(rows, in_features, out_features, rows, bias=True))
    packed = torch.ops.pagedserve.pack_linear_weight(weight)
    assert torch.equal(packed, reference.pack_linear_weight(weight, panel=packed.shape[2] // 2))
    y = torch.ops.pagedserve.skinny_linear(x, packed, bias, out_features)
    expected = x.float() @ weight.float().t() + bias.float()  # exact products, fp32 sums, one rounding
    assert y.dtype == torch.bfloat16 and relative_error(y.float(), expected) <= 2 ** -8
    assert torch.equal(reference.skinny_linear(x, packed, bias, out_features), expected.bfloat16())


def test_packs_supported_dtypes_on_cpu_only(ext_ops):
    weight = torch.randn(8, 8)
    assert ext_ops.pack_linear(weight, None) is not None
    assert cuda_ext.pack_linear(weight.half(), None) is None
    bf16_wanted = torch.ops.pagedserve.skinny_linear_supports(torch.bfloat16)
    assert (cuda_ext.pack_linear(weight.bfloat16(), None) is not None) == bf16_wanted
    assert cuda_ext.load_ops("torch").pack_linear(weight, None) is None


def test_rejects_mismatched_shapes(ext_ops):
    packed = torch.ops.pagedserve.pack_linear_weight(torch.randn(100, 64))
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.pagedserve.skinny_linear(torch.randn(3, 65), packed, None, 100)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.pagedserve.skinny_linear(torch.randn(3, 64), packed, torch.randn(99), 100)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.pagedserve.skinny_linear(torch.randn(3, 64).double(), packed, None, 100)


@pytest.mark.parametrize("rows", [3, 4, 16, 20, 32])
@pytest.mark.parametrize("in_features", [64, 37, 896])
def test_bf16_strided_rows_match_contiguous_ones(ext_ops, rows, in_features):
    """Strided rows (AMX blocks read them in place when the row count is a multiple of 16, padded otherwise)
    give what the same rows give contiguous, on either side of the AMX threshold."""
    skip_without_bf16(torch.bfloat16)
    x, weight, bias = (t.bfloat16() for t in random_layer(rows, in_features, 300, rows, bias=True))
    packed = torch.ops.pagedserve.pack_linear_weight(weight)
    strided = torch.cat([x, x], dim=1)[:, in_features:]
    y = torch.ops.pagedserve.skinny_linear(strided, packed, bias, 300)
    assert torch.equal(y, torch.ops.pagedserve.skinny_linear(x.contiguous(), packed, bias, 300))
    expected = x.float() @ weight.float().t() + bias.float()
    assert relative_error(y.float(), expected) <= 2 ** -8
