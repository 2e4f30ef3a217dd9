"""The linear-attention ops (Gated DeltaNet's causal conv1d and gated delta rule over state slots): the reference
against transformers' own torch functions, then the compiled ops against the reference, for several sequences of
mixed lengths, fresh and continued states, grouped value heads and snapshot saves inside a chunk."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from cuda_ext import reference_recurrent as ref

HK, HV, DK, DV, C, K = 2, 4, 16, 8, 24, 4
LENGTHS = [1, 5, 70, 1, 17]  # a decode, short prefills, one past a 64-token chunk, a 1-token prompt
INITIAL = [True, False, True, True, False]


def _step(lengths: list[int], seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return dict(q=rand(t, HK, DK), k=rand(t, HK, DK), v=rand(t, HV, DV),
                g=-F.softplus(rand(t, HV)), beta=torch.sigmoid(rand(t, HV)),
                x=rand(t, C), weight=rand(C, K) * 0.3,
                qsl=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32))


def _pools(slots: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, HV, DK, DV, generator=gen) * 0.1, torch.randn(slots, C, K - 1, generator=gen))


def _no_saves(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((n,), -1, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)


def _hf_delta(s: dict, i: int, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = s["qsl"][i].item(), s["qsl"][i + 1].item()
    args = [s[name][a:b].unsqueeze(0) for name in ("q", "k", "v", "g", "beta")]
    run = hf.torch_recurrent_gated_delta_rule if b - a == 1 and state is not None else hf.torch_chunk_gated_delta_rule
    out, final = run(*args[:3], g=args[3], beta=args[4], initial_state=None if state is None else state[None],
                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


def test_gated_delta_rule_reference_is_transformers() -> None:
    s = _step(LENGTHS)
    states, _ = _pools(8)
    before = states.clone()
    slots = torch.tensor([3, 0, 7, 5, 1])
    out = ref.gated_delta_rule(s["q"], s["k"], s["v"], s["g"], s["beta"], states, slots, s["qsl"],
                               torch.tensor(INITIAL), *_no_saves(5))
    for i, slot in enumerate(slots.tolist()):
        want, final = _hf_delta(s, i, before[slot] if INITIAL[i] else None)
        a, b = s["qsl"][i].item(), s["qsl"][i + 1].item()
        torch.testing.assert_close(out[a:b], want, rtol=0, atol=0)
        torch.testing.assert_close(states[slot], final, rtol=0, atol=0)


def test_causal_conv1d_reference_is_transformers() -> None:
    s = _step(LENGTHS)
    _, conv = _pools(8)
    before = conv.clone()
    slots = torch.tensor([3, 0, 7, 5, 1])
    out = ref.causal_conv1d(s["x"], s["weight"], conv, slots, s["qsl"], torch.tensor(INITIAL), *_no_saves(5))
    for i, slot in enumerate(slots.tolist()):
        a, b = s["qsl"][i].item(), s["qsl"][i + 1].item()
        rows = s["x"][a:b].t().unsqueeze(0)
        if INITIAL[i]:
            state = before[slot].clone().unsqueeze(0)
            want = hf.causal_conv1d_update(rows, state, s["weight"], None, activation="silu")
            torch.testing.assert_close(conv[slot], state[0], rtol=0, atol=0)
        else:
            want = hf.causal_conv1d_fn(rows, s["weight"], None, activation="silu")
        torch.testing.assert_close(out[a:b], want[0].t(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("cut", [1, 16, 64, 69])
def test_a_snapshot_is_the_state_after_its_prefix(cut: int) -> None:
    """Saving after ``cut`` rows of a 70-token prefill gives the state (and conv window) a prefill of those rows
    alone ends with; the sequence's own final state is unchanged by the save."""
    s = _step([70])
    states, conv = _pools(3)
    args = (torch.tensor([0]), s["qsl"], torch.tensor([True]))
    save = (torch.tensor([2]), torch.tensor([cut]))
    ref.gated_delta_rule(s["q"], s["k"], s["v"], s["g"], s["beta"], states, *args, *save)
    ref.causal_conv1d(s["x"], s["weight"], conv, *args, *save)
    alone, alone_conv = _pools(3)
    head = {k: v[:cut] for k, v in s.items() if k not in ("weight", "qsl")}
    prefix = (torch.tensor([0]), torch.tensor([0, cut], dtype=torch.int32), torch.tensor([True]), *_no_saves(1))
    ref.gated_delta_rule(head["q"], head["k"], head["v"], head["g"], head["beta"], alone, *prefix)
    ref.causal_conv1d(head["x"], s["weight"], alone_conv, *prefix)
    torch.testing.assert_close(states[2], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv[2], alone_conv[0], rtol=0, atol=0)


def test_compiled_ops_match_the_reference(ext_ops) -> None:
    s = _step(LENGTHS, seed=3)
    slots, init = torch.tensor([3, 0, 7, 5, 1]), torch.tensor(INITIAL)
    saves = (torch.tensor([-1, 2, 6, -1, 4]), torch.tensor([0, 3, 64, 0, 17]))
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, x, w = (s[name].to(dtype) for name in ("q", "k", "v", "x", "weight"))
        states, conv = _pools(8)
        conv = conv.to(dtype)
        want_states, want_conv = states.clone(), conv.clone()
        want = ref.gated_delta_rule(q, k, v, s["g"], s["beta"], want_states, slots, s["qsl"], init, *saves)
        got = ext_ops.gated_delta_rule(q, k, v, s["g"], s["beta"], states, slots, s["qsl"], init, *saves)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        torch.testing.assert_close(states, want_states, rtol=tol, atol=tol)
        want_out = ref.causal_conv1d(x, w, want_conv, slots, s["qsl"], init, *saves)
        got_out = ext_ops.causal_conv1d(x, w, conv, slots, s["qsl"], init, *saves)
        torch.testing.assert_close(got_out, want_out, rtol=tol, atol=tol)
        torch.testing.assert_close(conv, want_conv, rtol=0, atol=0)
