"""fused_moe (the grouped expert GEMM, compiled for CPU and CUDA) against the reference's per-token loop, and the
reference against a dense formula (every expert on every token, masked to the routed ones)."""

from __future__ import annotations

import pytest
import torch

from cuda_ext import reference

from .paged_batch import DEVICES

HIDDEN, INTERMEDIATE = 96, 40


def moe_inputs(tokens: int, experts: int, k: int, seed: int, dtype: torch.dtype, device: str,
               idle: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
    """Random hidden states and experts; each token's k distinct experts drawn from those not in ``idle``
    (experts no token picks), with softmax-normalised weights."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    w13 = torch.randn(experts, 2 * INTERMEDIATE, HIDDEN, generator=gen) * HIDDEN ** -0.5
    w2 = torch.randn(experts, HIDDEN, INTERMEDIATE, generator=gen) * INTERMEDIATE ** -0.5
    scores = torch.rand(tokens, experts, generator=gen)
    scores[:, list(idle)] = -1.0
    ids = scores.topk(k, dim=-1).indices
    weights = torch.randn(tokens, k, generator=gen).softmax(dim=-1)
    return (*(t.to(dtype=dtype, device=device) for t in (hidden, w13, w2)), ids.to(device), weights.to(device))


def dense_moe(hidden, w13, w2, ids, weights, gate_fn=torch.nn.functional.silu) -> torch.Tensor:
    """Every expert on every token in fp32, each output scaled by the token's weight for it (0: not routed)."""
    gate_up = torch.einsum("th,eih->eti", hidden.float(), w13.float())
    gate, up = gate_up.chunk(2, dim=-1)
    outs = torch.einsum("eti,ehi->eth", gate_fn(gate) * up, w2.float())
    share = torch.zeros(hidden.shape[0], w13.shape[0], device=hidden.device).scatter_(1, ids, weights.float())
    return torch.einsum("te,eth->th", share, outs)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("tokens, experts, k", [(1, 8, 2), (37, 8, 1), (37, 8, 2), (64, 16, 4), (300, 6, 2)])
def test_reference_matches_dense_formula(tokens, experts, k):
    inputs = moe_inputs(tokens, experts, k, seed=tokens + k, dtype=torch.float32, device="cpu")
    assert relative_error(reference.fused_moe(*inputs), dense_moe(*inputs)) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, k, idle", [
    (1, 8, 1, ()), (1, 8, 2, ()), (1, 16, 4, ()),  # a decode row: most experts get no token
    (5, 8, 2, (0, 3, 7)), (64, 8, 2, (1,)), (64, 16, 4, (2, 9, 15)), (200, 4, 4, ()),
])
def test_matches_reference(ext_ops, device, dtype, tokens, experts, k, idle):
    inputs = moe_inputs(tokens, experts, k, seed=tokens * experts + k, dtype=dtype, device=device, idle=idle)
    with torch.inference_mode():  # as the engine runs it (the op's threads must see the mode too)
        got = ext_ops.fused_moe(*inputs)
    want = reference.fused_moe(*inputs)
    assert got.dtype == dtype and got.shape == (tokens, HIDDEN)
    # fp32: the GEMMs' sum order; bf16: their inputs rounded at the same points, the sums one rounding apart.
    assert relative_error(got, want) <= (1e-5 if dtype == torch.float32 else 2 ** -8)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Gemma 4's experts' gate (transformers' gelu_pytorch_tanh)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


@pytest.mark.parametrize("tokens, experts, k", [(1, 8, 2), (37, 8, 4), (64, 16, 4)])
def test_reference_gelu_tanh_matches_dense_formula(tokens, experts, k):
    inputs = moe_inputs(tokens, experts, k, seed=tokens + 1, dtype=torch.float32, device="cpu")
    got = reference.fused_moe(*inputs, activation="gelu_tanh")
    assert relative_error(got, dense_moe(*inputs, gate_fn=gelu_tanh)) <= 1e-5
    assert relative_error(got, reference.fused_moe(*inputs)) > 1e-2  # not SiLU's


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, k, idle", [(1, 8, 2, ()), (64, 16, 4, (2, 9, 15))])
def test_gelu_tanh_matches_reference(ext_ops, device, dtype, tokens, experts, k, idle):
    inputs = moe_inputs(tokens, experts, k, seed=tokens + experts, dtype=dtype, device=device, idle=idle)
    with torch.inference_mode():
        got = ext_ops.fused_moe(*inputs, activation="gelu_tanh")
    want = reference.fused_moe(*inputs, activation="gelu_tanh")
    assert relative_error(got, want) <= (1e-5 if dtype == torch.float32 else 2 ** -8)


@pytest.mark.parametrize("fused_moe", ["reference", "compiled"])
def test_rejects_unknown_activations(ext_ops, fused_moe):
    op = reference.fused_moe if fused_moe == "reference" else ext_ops.fused_moe
    inputs = moe_inputs(3, 4, 2, seed=0, dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="activation must be 'silu' or 'gelu_tanh', got 'relu'"):
        op(*inputs, activation="relu")
    with pytest.raises(RuntimeError, match="clamped SwiGLU .* gates with silu, not gelu_tanh"):
        op(*inputs, swiglu_alpha=1.702, swiglu_limit=7.0, activation="gelu_tanh")


@pytest.mark.parametrize("device", DEVICES)
def test_no_tokens(ext_ops, device):
    hidden, w13, w2, ids, weights = moe_inputs(3, 4, 2, seed=0, dtype=torch.float32, device=device)
    out = ext_ops.fused_moe(hidden[:0], w13, w2, ids[:0], weights[:0])
    assert out.shape == (0, HIDDEN)


def test_rejects_bad_expert_ids(ext_ops):
    hidden, w13, w2, ids, weights = moe_inputs(3, 4, 2, seed=0, dtype=torch.float32, device="cpu")
    ids[1, 0] = 4
    with pytest.raises(RuntimeError, match="expert id 4 outside"):
        ext_ops.fused_moe(hidden, w13, w2, ids, weights)
    with pytest.raises(RuntimeError, match="w2 must be"):
        ext_ops.fused_moe(hidden, w13, w2[:, :, :-1], ids.clamp(max=3), weights)


def with_biases(inputs: tuple[torch.Tensor, ...], seed: int) -> tuple[torch.Tensor, ...]:
    """moe_inputs plus random expert biases, w13's and w2's, in the weights' dtype and device."""
    hidden, w13, w2, ids, weights = inputs
    gen = torch.Generator().manual_seed(seed)
    biases = (torch.randn(w.shape[:2], generator=gen).to(w) for w in (w13, w2))
    return (hidden * 4, w13, w2, ids, weights, *biases)  # * 4: past the clamp's limit often


def dense_swiglu_moe(hidden, w13, w2, ids, weights, b13, b2, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts, every one on every token in fp32, as transformers writes them."""
    gate_up = torch.einsum("th,eih->eti", hidden.float(), w13.float()) + b13.float()[:, None]
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    act = (up + 1) * gate * torch.sigmoid(gate * alpha)
    outs = torch.einsum("eti,ehi->eth", act, w2.float()) + b2.float()[:, None]
    share = torch.zeros(hidden.shape[0], w13.shape[0], device=hidden.device).scatter_(1, ids, weights.float())
    return torch.einsum("te,eth->th", share, outs)


@pytest.mark.parametrize("tokens, experts, k", [(1, 8, 2), (37, 8, 4), (64, 16, 4)])
def test_reference_biases_and_clamped_swiglu(tokens, experts, k):
    inputs = with_biases(moe_inputs(tokens, experts, k, seed=tokens, dtype=torch.float32, device="cpu"), tokens)
    got = reference.fused_moe(*inputs, swiglu_alpha=1.702, swiglu_limit=2.0)
    assert relative_error(got, dense_swiglu_moe(*inputs, 1.702, 2.0)) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha, limit", [(0.0, 0.0), (1.702, 2.0)], ids=["silu", "clamped-swiglu"])
def test_biases_and_activation_match_reference(ext_ops, device, dtype, alpha, limit):
    inputs = with_biases(moe_inputs(64, 8, 4, seed=7, dtype=dtype, device=device, idle=(3,)), 7)
    with torch.inference_mode():
        got = ext_ops.fused_moe(*inputs, swiglu_alpha=alpha, swiglu_limit=limit)
    want = reference.fused_moe(*inputs, swiglu_alpha=alpha, swiglu_limit=limit)
    assert relative_error(got, want) <= (1e-5 if dtype == torch.float32 else 2 ** -7)


def test_rejects_bad_biases(ext_ops):
    hidden, w13, w2, ids, weights, b13, b2 = with_biases(moe_inputs(3, 4, 2, seed=0, dtype=torch.float32,
                                                                    device="cpu"), 0)
    with pytest.raises(RuntimeError, match="w13_bias must be \\[4, 80\\]"):
        ext_ops.fused_moe(hidden, w13, w2, ids, weights, b13[:, :-1], b2)
    with pytest.raises(RuntimeError, match="w2_bias must be Float on cpu"):
        ext_ops.fused_moe(hidden, w13, w2, ids, weights, b13, b2.double())
