"""The fused decoder-layer ops (residual add + RMSNorm, rotary, SiLU-and-mul), compiled, against the reference."""

from __future__ import annotations

import pytest
import torch

from cuda_ext import reference

from .paged_batch import DEVICES


def dtypes_for(device: str) -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16] + ([torch.float16] if device == "cuda" else [])


def randn(*shape: int, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: a few ulps (sum order, exp); 16-bit: the same rounding points, so at most one ulp apart."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        ulp = want.float().abs().clamp(min=1e-3) * (2 ** -7 if want.dtype == torch.bfloat16 else 2 ** -10)
        assert ((got.float() - want.float()).abs() <= ulp).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows, hidden", [(1, 256), (7, 896), (64, 37), (300, 512)])
def test_fused_add_rms_norm(ext_ops, device, rows, hidden):
    for seed, dtype in enumerate(dtypes_for(device)):
        x = randn(rows, 2 * hidden, seed=seed, dtype=dtype, device=device)[:, hidden:]  # strided rows
        residual = randn(rows, hidden, seed=seed + 1, dtype=dtype, device=device)
        weight = randn(hidden, seed=seed + 2, dtype=dtype, device=device)
        want_residual = residual.clone()
        want = reference.fused_add_rms_norm(want_residual, x, weight, 1e-6)
        got = ext_ops.fused_add_rms_norm(residual, x, weight, 1e-6)
        assert torch.equal(residual, want_residual)  # the add rounds once, either way
        assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens, heads, head_size", [(1, 6, 64), (13, 3, 128), (64, 16, 40), (200, 2, 256)])
def test_rotary_embedding_on_fused_qk_view(ext_ops, device, tokens, heads, head_size):
    max_position = 512
    for seed, dtype in enumerate(dtypes_for(device)):
        qkv = randn(tokens, heads + 2, head_size, seed=seed, dtype=dtype, device=device)
        qk = qkv[:, :heads]  # strided over tokens, as the model's q|k view of its fused projection
        angles = torch.rand(max_position, head_size // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
        cos, sin = (f(angles).to(dtype=dtype, device=device) for f in (torch.cos, torch.sin))
        positions = torch.randint(0, max_position, (tokens,), generator=torch.Generator().manual_seed(seed)).to(device)
        want = qkv.clone()
        reference.rotary_embedding(want[:, :heads], positions, cos, sin)
        ext_ops.rotary_embedding(qk, positions, cos, sin)
        assert torch.equal(qkv[:, heads:], want[:, heads:])  # v untouched
        assert_close(qkv, want)


def test_rotary_matches_hf_formula():
    """The reference's halves formula is Hugging Face's ``x * cos + rotate_half(x) * sin``, bit for bit."""
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(5, 4, 64, seed=3, dtype=dtype, device="cpu")
        half = torch.rand(100, 32, generator=torch.Generator().manual_seed(4))
        cos, sin = half.cos().to(dtype), half.sin().to(dtype)
        positions = torch.tensor([0, 5, 99, 7, 7])
        c, s = (torch.cat((t, t), dim=-1)[positions].unsqueeze(1) for t in (cos, sin))
        x1, x2 = x.chunk(2, dim=-1)
        want = x * c + torch.cat((-x2, x1), dim=-1) * s
        reference.rotary_embedding(x, positions, cos, sin)
        assert torch.equal(x, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows, d", [(1, 688), (9, 4864), (64, 17), (300, 256)])
@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_act_and_mul(ext_ops, device, rows, d, op):
    for seed, dtype in enumerate(dtypes_for(device)):
        x = randn(rows, 3 * d, seed=seed, dtype=dtype, device=device)[:, d:] * 4  # strided rows, wide range
        assert_close(getattr(ext_ops, op)(x), getattr(reference, op)(x))


def test_gelu_tanh_reference_is_hf_gelu_pytorch_tanh():
    from transformers.activations import ACT2FN

    x = randn(5, 64, seed=1, dtype=torch.float32, device="cpu") * 4
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(reference.gelu_tanh_and_mul(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)


def test_bad_arguments_are_rejected(ext_ops):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        ext_ops.fused_add_rms_norm(x.clone(), x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="differ in shape"):
        ext_ops.fused_add_rms_norm(torch.randn(3, 8), x, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="supports float32 and bfloat16"):
        ext_ops.silu_and_mul(x.half())
    with pytest.raises(RuntimeError, match="2 \\* d"):
        ext_ops.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="gelu_tanh_and_mul: x must be"):
        ext_ops.gelu_tanh_and_mul(torch.randn(4, 7))
    table = torch.randn(10, 4)
    with pytest.raises(RuntimeError, match="outside the table"):
        ext_ops.rotary_embedding(torch.randn(2, 3, 8), torch.tensor([0, 10]), table, table)
    with pytest.raises(RuntimeError, match="positions must be int64"):
        ext_ops.rotary_embedding(torch.randn(2, 3, 8), torch.tensor([0, 1], dtype=torch.int32), table, table)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows, n", [(1, 32000), (64, 32000), (5, 37), (3, 1), (7, 151936)])
def test_row_argmax_matches_torch(ext_ops, device, rows, n):
    x = randn(rows, n, seed=rows + n, dtype=torch.float32, device=device)
    x[0, n // 2] = x[0, n - 1] = x[0].max() + 1  # a tie: the first wins
    if rows > 2:
        x[1] = float("-inf")
        x[2, n // 3] = float("nan")
        x[2, -1] = float("nan")  # the first NaN wins
    assert torch.equal(ext_ops.row_argmax(x), x.argmax(dim=-1))
    strided = torch.cat([x, x], dim=1)[:, n:]
    assert torch.equal(ext_ops.row_argmax(strided), x.argmax(dim=-1))
    assert torch.equal(ext_ops.row_argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, words", [(32000, 1000), (37, 2), (40, 1)])  # (40, 1): tokens past the bitmask
def test_apply_token_bitmask_matches_xgrammar(ext_ops, device, dtype, n, words):
    import xgrammar as xgr

    g = torch.Generator().manual_seed(n)
    bitmask = torch.randint(-2**31, 2**31, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0] = 0  # nothing allowed
    bitmask[1, : words // 2] = -1  # all allowed
    logits = randn(6, n, seed=n, dtype=dtype, device=device)
    rows = torch.tensor([4, 0, 2])
    expected = logits.float().cpu()
    masked = torch.zeros(3, n)
    masked[:, : min(n, 32 * words)] = expected[rows, : min(n, 32 * words)]
    xgr.apply_token_bitmask_inplace(masked, bitmask)
    masked[:, 32 * words:] = float("-inf")
    expected[rows] = masked
    for apply in (ext_ops.apply_token_bitmask, reference.apply_token_bitmask):
        out = logits.clone()
        apply(out, bitmask, rows)
        assert torch.equal(out.float().cpu(), expected)
    strided = torch.cat([logits, logits], dim=1)[:, n:]
    assert torch.equal(ext_ops.masked_row_argmax(strided, bitmask, rows).cpu(), expected[rows].argmax(dim=-1))
    assert torch.equal(reference.masked_row_argmax(strided, bitmask, rows).cpu(), expected[rows].argmax(dim=-1))
    ext_ops.apply_token_bitmask(strided, bitmask, rows)
    assert torch.equal(strided.float().cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_masked_row_argmax_ties_nans_and_dead_rows(ext_ops, device):
    """row_argmax's rules on the masked row: the first maximum, the first allowed NaN, 0 when all is -inf."""
    logits = torch.zeros(5, 70, device=device)
    logits[0, [5, 40, 69]] = 3.0  # a tie among allowed tokens, and 69 in the bitmask's partial last word
    logits[1, [3, 50]] = float("nan")  # 3 forbidden, 50 allowed
    logits[2] = float("-inf")  # allowed tokens all -inf
    logits[4, [20, 33, 60]] = torch.tensor([5.0, float("nan"), float("nan")])  # NaNs inside fully allowed words
    bitmask = torch.full((5, 3), -1, dtype=torch.int32)
    bitmask[0] = torch.tensor([1 << 7, 1 << 8, 1 << 5], dtype=torch.int32)  # tokens 7, 40, 69
    bitmask[1] = torch.tensor([0, 1 << 18, 0], dtype=torch.int32)  # token 50
    bitmask[3] = 0  # nothing allowed; rows 2 and 4: everything
    rows = torch.arange(5)
    want = torch.tensor([40, 50, 0, 0, 33])
    masked = logits.clone()
    reference.apply_token_bitmask(masked, bitmask, rows)
    assert torch.equal(masked.argmax(dim=-1).cpu(), want)
    assert torch.equal(ext_ops.masked_row_argmax(logits, bitmask, rows).cpu(), want)
    assert torch.equal(ext_ops.masked_row_argmax(logits.bfloat16(), bitmask, rows).cpu(), want)


def test_apply_token_bitmask_rejects_bad_rows(ext_ops):
    with pytest.raises(RuntimeError, match="out of range"):
        ext_ops.apply_token_bitmask(torch.zeros(2, 32), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="int32"):
        ext_ops.apply_token_bitmask(torch.zeros(2, 32), torch.zeros(1, 1), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="masked_row_argmax: row -1 out of range"):
        ext_ops.masked_row_argmax(torch.zeros(2, 32), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([-1]))
