"""The screened argmax (pack_argmax_screen + skinny_argmax_screened, CPU): an fp32 LM head's greedy tokens from
a bf16 pass and an fp32 recompute of the columns its error bound cannot rule out, and a bf16 LM head's from an
int8 pass and the bf16 GEMM's own tiles on the rest. It must give exactly the fused argmax's tokens
(skinny_linear_argmax), ties and near-ties included."""

from __future__ import annotations

import pytest
import torch

import cuda_ext

from .test_skinny_gemm import random_layer, torch_threads

pytestmark = pytest.mark.usefixtures("ext_ops")


@pytest.fixture(autouse=True)
def _needs_bf16() -> None:
    if not torch.ops.pagedserve.argmax_screen_supports(torch.float32):
        pytest.skip("this build has no bf16 skinny GEMM (CPU without AVX512-BF16): LM heads keep the fused argmax")


def screened(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    screen, bounds = torch.ops.pagedserve.pack_argmax_screen(weight, bias)
    return torch.ops.pagedserve.skinny_argmax_screened(x, weight, screen, bounds, bias)


def fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = torch.ops.pagedserve.pack_linear_weight(weight)
    return torch.ops.pagedserve.skinny_linear_argmax(x, packed, bias, weight.shape[0])[1]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 256, 32000), (64, 256, 32000), (7, 37, 100),
                                                            (13, 129, 1000), (65, 64, 17), (130, 64, 2000)])
def test_is_the_fused_argmax(threads, rows, in_features, out_features):
    x, weight, bias = random_layer(rows, in_features, out_features, rows + in_features, bias=True)
    with torch_threads(threads):
        for scale in (1.0, 1e-3, 300.0):
            for b in (None, bias):
                assert torch.equal(screened(x * scale, weight, b), fused(x * scale, weight, b))


def test_ties_and_near_ties():
    """Equal logits: the first column wins. Columns the bf16 pass cannot tell apart (one fp32 ulp apart, or
    equal in bf16): the fp32 recompute decides. Integer data makes exact ties everywhere."""
    x, weight, _ = random_layer(9, 64, 3000, 5, bias=False)
    weight[2999], weight[1500], weight[70] = weight[7], weight[7], weight[7]
    weight[2000] = weight[300] * (1 + 2 ** -22)  # same bf16 row, larger fp32 logits where they are positive
    weight[2001] = weight[301].bfloat16().float() + weight[301] * 2 ** -12  # equal after bf16 rounding
    for w in (weight, weight.round()):
        for xs in (x, x.round(), torch.cat([w[[7, 300, 301, 2001]], -w[[300]]])):
            assert torch.equal(screened(xs, w, None), fused(xs, w, None))
    assert screened(weight[[7, 300]] * 10, weight, None).tolist() == [7, 2000]


def test_rows_the_bound_cannot_cover_fall_back():
    """NaN, inf and huge rows are answered from plain fp32 logits, with torch.argmax's rules (the first NaN)."""
    x, weight, bias = random_layer(4, 64, 500, 9, bias=True)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] *= 1e35
    want = torch.nn.functional.linear(x, weight, bias).argmax(-1)
    assert torch.equal(screened(x, weight, bias), want)
    assert screened(torch.empty(0, 64), weight, bias).shape == (0,)


def test_rejects_non_finite_weights_and_mismatched_inputs():
    _, weight, bias = random_layer(1, 64, 100, 2, bias=True)
    with pytest.raises(RuntimeError, match="finite"):
        torch.ops.pagedserve.pack_argmax_screen(weight.index_fill(0, torch.tensor([3]), float("inf")), None)
    screen, bounds = torch.ops.pagedserve.pack_argmax_screen(weight, bias)
    with pytest.raises(RuntimeError, match="fp32 x"):
        torch.ops.pagedserve.skinny_argmax_screened(torch.randn(2, 65), weight, screen, bounds, bias)
    with pytest.raises(RuntimeError, match="bounds"):
        torch.ops.pagedserve.skinny_argmax_screened(torch.randn(2, 64), weight, screen, bounds[:, 1:], bias)


def test_packed_lm_head_argmax():
    """pack_linear(screen_argmax=True): fp32 layers get a screen, and ``argmax`` is ``with_argmax``'s argmax."""
    x, weight, bias = random_layer(20, 96, 4000, 3, bias=True)
    head = cuda_ext.pack_linear(weight, bias, screen_argmax=True)
    assert head.screen is not None and cuda_ext.pack_linear(weight, bias).screen is None
    assert torch.equal(head.argmax(x), head.with_argmax(x)[1])
    assert torch.equal(head.argmax(x), (x @ weight.t() + bias).argmax(-1))


def _needs_int8_screen() -> None:
    if not torch.ops.pagedserve.argmax_screen_supports(torch.bfloat16):
        pytest.skip("no int8 screen for bf16 here (needs AVX512-VNNI, and not on AMX CPUs)")


def screened_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = torch.ops.pagedserve.pack_linear_weight(weight)
    screen, bounds = torch.ops.pagedserve.pack_argmax_screen(weight, bias)
    return torch.ops.pagedserve.skinny_argmax_screened(x, packed, screen, bounds, bias)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 256, 32000), (4, 896, 20000), (3, 37, 100),
                                                            (2, 130, 1000), (4, 64, 17), (9, 64, 2000)])
def test_bf16_is_the_fused_argmax(threads, rows, in_features, out_features):
    """bf16 layers: an int8 pass and the bf16 GEMM's own tiles on the survivors' panels give its fused argmax
    (over bf16-rounded logits, the first maximum), at every scale; past 4 rows the fused argmax answers."""
    _needs_int8_screen()
    x, weight, bias = random_layer(rows, in_features, out_features, rows + in_features, bias=True)
    weight = (weight * 0.05).bfloat16()
    with torch_threads(threads):
        for scale in (1.0, 1e-3, 300.0):
            for b in (None, bias.bfloat16()):
                xs = (x * scale).bfloat16()
                assert torch.equal(screened_bf16(xs, weight, b), fused(xs, weight, b))


def test_bf16_ties_outliers_and_rows_it_cannot_bound():
    """Duplicate columns (exact ties: the first wins), columns equal after bf16 rounding, an activation outlier
    (a coarse int8 scale: many survivors), and non-finite rows (answered by the fused argmax)."""
    _needs_int8_screen()
    x, weight, _ = random_layer(4, 64, 3000, 5, bias=False)
    weight = weight.bfloat16()
    weight[2999], weight[1500], weight[70] = weight[7], weight[7], weight[7]
    x = x.bfloat16()
    assert torch.equal(screened_bf16(weight[[7, 70, 300]], weight, None), fused(weight[[7, 70, 300]], weight, None))
    assert screened_bf16(weight[[7]] * 4, weight, None).tolist() == [7]
    outlier = x.clone()
    outlier[0, 3] = 1000.0
    assert torch.equal(screened_bf16(outlier, weight, None), fused(outlier, weight, None))
    bad = x.clone()
    bad[1, 2], bad[2, 5] = float("nan"), float("inf")
    assert torch.equal(screened_bf16(bad, weight, None), fused(bad, weight, None))
    nan_only = x.clone()  # a NaN without an inf beside it: the screen must see it too
    nan_only[3, 7] = float("nan")
    assert torch.equal(screened_bf16(nan_only, weight, None), fused(nan_only, weight, None))
    assert screened_bf16(torch.empty(0, 64).bfloat16(), weight, None).shape == (0,)


def test_bf16_near_duplicate_columns_need_the_bound():
    """400 columns a hair apart, the rows pointing their way: the int8 estimates order them wrongly, so only
    the error bound's survivors and their exact recompute find the argmax (a screen without its bound fails
    here)."""
    _needs_int8_screen()
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(256, generator=gen)
    near, other = base + 0.03 * torch.randn(400, 256, generator=gen), torch.randn(1600, 256, generator=gen)
    weight = torch.cat([other[:800], near, other[800:]]).bfloat16()
    x = (base + 0.1 * torch.randn(4, 256, generator=gen)).bfloat16()
    assert torch.equal(screened_bf16(x, weight, None), fused(x, weight, None))


def test_packed_bf16_lm_head_argmax():
    """pack_linear(screen_argmax=True) on a bf16 layer: where the CPU has the int8 screen, ``argmax`` screens
    (from the layer's own panels) and gives ``with_argmax``'s argmax."""
    x, weight, _ = random_layer(3, 96, 4000, 3, bias=False)
    head = cuda_ext.pack_linear(weight.bfloat16(), None, screen_argmax=True)
    if head is None:
        pytest.skip("bf16 layers stay on F.linear here")
    assert (head.screen is not None) == torch.ops.pagedserve.argmax_screen_supports(torch.bfloat16)
    if head.screen is not None:
        assert head.screen.weight is head.packed and head.screen.screen.dtype == torch.int8
    for rows in (1, 3):
        xs = x[:rows].bfloat16()
        assert torch.equal(head.argmax(xs), head.with_argmax(xs)[1])
