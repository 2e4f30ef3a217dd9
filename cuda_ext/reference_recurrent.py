"""Pure-torch reference of the linear-attention ops (Gated DeltaNet: Qwen3-Next, Qwen3.5): the causal depthwise
convolution over a sequence's recent inputs and the gated delta rule over its recurrent matrix, both reading and
writing per-sequence state slots of a pool in place.

A step's rows are its sequences' new tokens one after another (``query_start_loc``); sequence ``i`` continues
the state in slot ``slots[i]`` where ``has_initial[i]`` (else it starts from zeros), leaves its final state there,
and, where ``save_slots[i] >= 0``, also writes the state it had after its first ``save_offsets[i]`` rows into that
slot (a prefix-cache snapshot at a block boundary). The arithmetic is transformers' torch path: the chunked form
for a prefill, the one-token update for a decode."""
from __future__ import annotations

import torch
import torch.nn.functional as F

_CHUNK = 64  # tokens per chunk of the chunked form (transformers' and FLA's default)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                  query_start_loc: torch.Tensor, has_initial: torch.Tensor, save_slots: torch.Tensor,
                  save_offsets: torch.Tensor) -> torch.Tensor:
    """x [T, C], weight [C, K], conv_states [S, C, K - 1] (x's dtype) -> silu(conv(x)) [T, C]. A slot holds the
    last K - 1 inputs of its sequence (channels first)."""
    out = torch.empty_like(x)
    bounds = query_start_loc.tolist()
    for i, (slot, save) in enumerate(zip(slots.tolist(), save_slots.tolist())):
        rows = x[bounds[i]:bounds[i + 1]]
        prior = conv_states[slot] if has_initial[i] else conv_states.new_zeros(conv_states.shape[1:])
        window = torch.cat((prior, rows.t()), dim=1)  # [C, K - 1 + n]
        conv = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]
        out[bounds[i]:bounds[i + 1]] = F.silu(conv).t()
        width = conv_states.shape[2]
        if save >= 0:
            offset = int(save_offsets[i])
            conv_states[save] = window[:, offset:offset + width]
        conv_states[slot] = window[:, window.shape[1] - width:]
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor, query_start_loc: torch.Tensor,
                     has_initial: torch.Tensor, save_slots: torch.Tensor, save_offsets: torch.Tensor) -> torch.Tensor:
    """q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (the log decay, <= 0) and beta [T, Hv] fp32; states [S, Hv, Dk, Dv]
    fp32 -> the output [T, Hv, Dv] in v's dtype. q and k are l2-normalised and q scaled by Dk^-0.5 here; a key
    head serves Hv / Hk consecutive value heads."""
    out = torch.empty_like(v)
    bounds = query_start_loc.tolist()
    for i, (slot, save) in enumerate(zip(slots.tolist(), save_slots.tolist())):
        a, b = bounds[i], bounds[i + 1]
        state = states[slot].clone() if has_initial[i] else states.new_zeros(states.shape[1:])
        cut = int(save_offsets[i]) if save >= 0 else b - a
        pieces = [(a, a + cut), (a + cut, b)] if 0 < cut < b - a else [(a, b)]
        for lo, hi in pieces:
            one_token = hi - lo == 1 and (has_initial[i] or lo > a)
            run = _recurrent if one_token else _chunked
            out[lo:hi], state = run(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
            if save >= 0 and hi - a == cut:
                states[save] = state
        states[slot] = state
    return out


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    """[n, H, D] -> [Hv, n, D] fp32, key heads repeated to the value heads, q and k l2-normalised."""
    repeat = v.shape[1] // k.shape[1]
    q, k = (t.repeat_interleave(repeat, dim=1) if repeat > 1 else t for t in (q, k))
    q, k, v, g, beta = (t.transpose(0, 1).float().contiguous() for t in (q, k, v, g, beta))
    q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    return q, k, v, g, beta


def _recurrent(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: S <- S * exp(g); S += k (beta (v - S^T k))^T; o = S^T q."""
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    q = q / q.shape[-1] ** 0.5  # transformers divides here, multiplies in the chunked form: same rounding
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        remembered = (state * k[:, t, :, None]).sum(dim=-2)
        delta = (v[:, t] - remembered) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (state * q[:, t, :, None]).sum(dim=-2)
    return out.transpose(0, 1).to(dtype), state


def _chunked(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence in chunks of ``_CHUNK`` tokens: within a chunk the delta updates are condensed into a
    unit-lower-triangular solve (the UT transform), between chunks the state carries over."""
    dtype, n = v.dtype, q.shape[0]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    q = q * q.shape[-1] ** -0.5
    pad = -n % _CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    heads, chunks = q.shape[0], (n + pad) // _CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(heads, chunks, _CHUNK, -1) for t in (q, k, k_beta, v_beta))
    decay = g.reshape(heads, chunks, _CHUNK).cumsum(dim=-1)
    future = torch.ones(_CHUNK, _CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(future, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    within = (q @ k.transpose(-1, -2)) * pair_decay
    solve = dict(upper=False, unitriangular=True)
    values = torch.linalg.solve_triangular(system, v_beta, **solve)
    key_reads = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], **solve)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for c in range(chunks):
        fresh = values[:, c] - key_reads[:, c] @ state
        out[:, c] = q[:, c] @ state + within[:, c] @ fresh
        state = state * chunk_decay[:, c] + k[:, c].transpose(-1, -2) @ fresh
    out = out.reshape(heads, chunks * _CHUNK, -1)[:, :n]
    return out.transpose(0, 1).to(dtype), state
