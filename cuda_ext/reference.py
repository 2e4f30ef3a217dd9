"""Pure-torch reference of every pagedserve op: the tests' ground truth and the
`attention_backend="torch"` fallback. Same signatures as the compiled ops.

KV layout (see cuda_ext/README.md): key_cache / value_cache are
[num_blocks, num_kv_heads, block_size, head_size] (possibly strided views of one
all-layer tensor); slot s = block s // block_size, offset s % block_size.

Quantized KV (int8 or float8_e4m3fn caches): each (slot, KV head) row of K and of V has its own bf16 scale, the
row's absmax over the largest code, in key_scale / value_scale [num_blocks, num_kv_heads, block_size] (views of
one all-layer tensor too). The K/V ops take them as optional trailing arguments; None means an unquantized cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cuda_ext import reference_recurrent

# Gated DeltaNet's state-carrying ops, kept in a module of their own.
causal_conv1d = reference_recurrent.causal_conv1d
gated_delta_rule = reference_recurrent.gated_delta_rule

# The largest code of each quantized KV dtype: a row's absmax maps to it.
KV_QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] in dtype, bf16 scales [...]): scale = bf16(absmax / max code), codes =
    x / scale (fp32 division), clamped (the bf16 rounding may shrink the scale a little), then int8 rounded half
    to even or cast to fp8. An all-zero row gets scale 0 and codes 0."""
    qmax = KV_QUANT_MAX[dtype]
    scale = (x.float().abs().amax(dim=-1) / qmax).to(torch.bfloat16)
    divisor = scale.float().masked_fill(scale == 0, 1.0)
    codes = (x.float() / divisor[..., None]).clamp(-qmax, qmax)
    return (codes.round() if dtype == torch.int8 else codes).to(dtype), scale


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Write token t's K/V ([T, Hkv, D]) into slot slot_mapping[t]; slot -1 is skipped. With scales the cache
    is quantized: the codes go to the cache, each (token, head) row's scale to key_scale / value_scale."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = key_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    for x, cache, scales in ((key, key_cache, key_scale), (value, value_cache, value_scale)):
        if scales is None:
            cache[blocks, :, offsets] = x[keep]
        else:
            codes, row_scales = quantize_kv(x[keep], cache.dtype)
            cache[blocks, :, offsets] = codes
            scales[blocks, :, offsets] = row_scales


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              scales: torch.Tensor | None = None) -> torch.Tensor:
    """The first seq_len tokens of one sequence's cache as a dense [Hkv, seq_len, D]; with scales, dequantised
    to fp32."""
    num_blocks = -(-seq_len // cache.shape[2])
    ids = block_table[:num_blocks].long()
    blocks = cache[ids]  # [n, Hkv, bs, D]
    if scales is not None:
        blocks = blocks.float() * scales[ids].float()[..., None]
    return blocks.transpose(0, 1).flatten(1, 2)[:, :seq_len]


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    bidirectional: list[tuple[int, int]] | None = None,
) -> None:
    """Causal attention of each sequence's query rows over its paged context, into out.

    Sequence b owns query rows [query_start_loc[b], query_start_loc[b+1]); its context
    is seq_lens[b] tokens including those rows, so row i sits at position
    seq_lens[b] - q_len + i and sees positions [0, that position], or with a sliding window
    the last ``sliding_window`` of them (transformers' rule: key j when position - j < window). A ``softcap``
    (Gemma 2) turns each scaled score s into softcap * tanh(s / softcap) before the softmax. ``sinks`` (fp32
    [num_heads], gpt-oss) gives each head one more logit that joins the softmax's denominator but has no value.
    fp32 math; a quantized cache (scales given) is dequantised first. ``bidirectional``: query row ranges
    [start, end), each within one sequence's rows, whose rows also see each other's later keys (an image's tokens
    in Gemma 3; the window still bounds the keys behind a row). The compiled kernels take none.
    """
    group = query.shape[1] // key_cache.shape[1]
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        # Keys before the first row's window are never read: the engine releases their blocks.
        lo = max(0, seq_len - (q1 - q0) - sliding_window + 1) if sliding_window else 0
        k, v = (gather_kv(cache, block_tables[b], seq_len, scales)[:, lo:].repeat_interleave(group, dim=0).float()
                for cache, scales in ((key_cache, key_scale), (value_cache, value_scale)))
        q = query[q0:q1].transpose(0, 1).float()  # [Hq, q_len, D]
        scores = soft_cap((q @ k.transpose(1, 2)) * scale, softcap)  # [Hq, q_len, seq_len - lo]
        positions = torch.arange(seq_len - (q1 - q0), seq_len, device=query.device)
        keys = torch.arange(lo, seq_len, device=query.device)[None, :]
        hidden = keys > positions[:, None]
        for start, end in bidirectional or ():
            if q0 <= start < q1:
                first = int(positions[start - q0])
                hidden[start - q0:end - q0] &= (keys < first) | (keys >= first + end - start)
        if sliding_window:
            hidden |= keys <= positions[:, None] - sliding_window
        probs = with_sinks(scores.masked_fill(hidden, float("-inf")), sinks).softmax(dim=-1)[..., :scores.shape[-1]]
        out[q0:q1] = (probs @ v).transpose(0, 1).to(out.dtype)


def with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """scores [Hq, ..., n] with each head's sink logit appended as a last column (the softmax drops its
    probability after); unchanged without sinks."""
    if sinks is None:
        return scores
    column = sinks.float().view(-1, *(1,) * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    return torch.cat((scores, column), dim=-1)


def soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """softcap * tanh(scores / softcap) in the eager formula's order; 0 = off."""
    return scores if not softcap else torch.tanh(scores / softcap) * softcap


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """kv_cache[dst] = kv_cache[src] for each (src, dst) row: whole blocks, all layers."""
    mapping = block_mapping.to(kv_cache.device)
    kv_cache[mapping[:, 1]] = kv_cache[mapping[:, 0]]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """dst[m[i, 1]] = src[m[i, 0]], across devices (device <-> CPU pool)."""
    rows = src[block_mapping[:, 0].to(src.device)]
    dst[block_mapping[:, 1].to(dst.device)] = rows.to(dst.device)


def fused_add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, in its dtype); returns RMSNorm(residual) * weight, Hugging Face's
    numerics: normalise in fp32, cast to the dtype, then scale."""
    residual.add_(x)
    h = residual.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotary_embedding(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [T, H, D] in place, neox layout (halves [x1 | x2] -> [x1 c - x2 s | x2 c + x1 s]),
    by the angles of ``positions`` [T]; cos / sin are [max_position, D / 2] tables in x's dtype.
    Each product is rounded to the dtype, as ``x * cos + rotate_half(x) * sin`` rounds."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] on the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for x = [gate | up] on the last dim (Gemma's GeGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              swiglu_alpha: float = 0.0, swiglu_limit: float = 0.0, activation: str = "silu") -> torch.Tensor:
    """Each token's top-k experts, summed under their routing weights: hidden [T, H], w13 [E, 2 * I, H] (each
    expert's gate rows, then its up rows), w2 [E, H, I], topk_ids int64 [T, k], topk_weights [T, k], optional
    biases w13_bias [E, 2 * I] and w2_bias [E, H]. Expert e maps x to act(x @ w13[e].T + w13_bias[e]) @ w2[e].T
    + w2_bias[e] in hidden's dtype, act ``activation``'s gated form (silu: silu_and_mul, gelu_tanh:
    gelu_tanh_and_mul), or with ``swiglu_alpha`` > 0 gpt-oss's clamped SwiGLU (``clamped_swiglu``); the weighted
    sum is fp32, rounded once."""
    act = expert_activation(activation, swiglu_alpha, swiglu_limit)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for t in range(hidden.shape[0]):
        for e, weight in zip(topk_ids[t].tolist(), topk_weights[t].float()):
            gate_up = add_bias(hidden[t:t + 1] @ w13[e].t(), w13_bias, e)
            out[t] += weight * add_bias(act(gate_up) @ w2[e].t(), w2_bias, e)[0].float()
    return out.to(hidden.dtype)


def expert_activation(activation: str, swiglu_alpha: float, swiglu_limit: float
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
    """fused_moe's gated activation, refused as the compiled op refuses it."""
    if activation not in ("silu", "gelu_tanh"):
        raise RuntimeError(f"fused_moe: activation must be 'silu' or 'gelu_tanh', got '{activation}'")
    if swiglu_alpha > 0:
        if activation != "silu":
            raise RuntimeError(f"fused_moe: the clamped SwiGLU (swiglu_alpha > 0) gates with silu, not {activation}")
        return lambda x: clamped_swiglu(x, swiglu_alpha, swiglu_limit)
    return silu_and_mul if activation == "silu" else gelu_tanh_and_mul


def add_bias(y: torch.Tensor, bias: torch.Tensor | None, expert: int) -> torch.Tensor:
    return y if bias is None else y + bias[expert]


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on x = [gate | up]: g = min(gate, limit), u = clamp(up, -limit, limit),
    (u + 1) * g * sigmoid(g * alpha), in transformers' order."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum of x [rows, n] (the first one; a NaN counts as the maximum), int64."""
    return x.argmax(dim=-1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: ``logits[rows[i], j] = -inf`` where bit ``j % 32`` of ``bitmask[i, j // 32]`` (int32, xgrammar's
    layout) is clear; tokens past the bitmask's ``32 * words`` are forbidden too."""
    n, dev = logits.shape[1], logits.device
    bits = (bitmask.to(dev).unsqueeze(-1) >> torch.arange(32, device=dev, dtype=torch.int32)) & 1
    allowed = bits.flatten(1)[:, :n].bool()
    allowed = torch.nn.functional.pad(allowed, (0, n - allowed.shape[1]))
    targets = rows.to(dev)
    logits[targets] = logits[targets].masked_fill(~allowed, float("-inf"))


def masked_row_argmax(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``row_argmax`` of each masked row ``logits[rows[i]]`` under ``apply_token_bitmask``'s mask, int64 [k]."""
    masked = logits[rows.to(logits.device)]
    apply_token_bitmask(masked, bitmask, torch.arange(len(rows)))
    return row_argmax(masked)


def pack_linear_weight(weight: torch.Tensor, panel: int = 64) -> torch.Tensor:
    """[out, in] -> panels of ``panel`` output columns, zero-padded past ``out``. fp32:
    [ceil(out / panel), in, panel], panel p holding columns [p * panel, (p + 1) * panel) as
    a dense [in, panel] run. bf16: k pairs interleaved, [ceil(out / panel), ceil(in / 2), panel, 2]
    flattened to [..., 2 * panel]. (The compiled op picks its panel width from the SIMD width.)"""
    out_features, in_features = weight.shape
    panels = -(-out_features // panel)
    padded = torch.nn.functional.pad(weight, (0, 0, 0, panels * panel - out_features))
    if weight.dtype != torch.bfloat16:
        return padded.view(panels, panel, in_features).transpose(1, 2).contiguous()
    pairs = -(-in_features // 2)
    even = torch.nn.functional.pad(padded, (0, 2 * pairs - in_features))
    return even.view(panels, panel, pairs, 2).permute(0, 2, 1, 3).reshape(panels, pairs, 2 * panel)


def skinny_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [rows, in] @ weight.T (+ bias), weight unpacked from pack_linear_weight's layout; fp32 math."""
    panels, in_rows, width = packed.shape
    if packed.dtype == torch.bfloat16:  # [panels, pairs, panel, 2] -> [panels, 2 * pairs, panel]
        packed = packed.view(panels, in_rows, width // 2, 2).transpose(2, 3).reshape(panels, 2 * in_rows, width // 2)
    weight = packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features, :x.shape[1]]
    y = x.float() @ weight.float().t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def skinny_linear_w8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    """x [rows, in] @ (q * scale[:, None]).T (+ bias), the int8 q unpacked from pack_linear_weight's layout; fp32
    math, the result in x's dtype."""
    q = packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]
    y = x.float() @ (q.float() * scale.float()[:, None]).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def dequantize_w4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """4-bit codes [out, in] (uint8 0..15) -> (code - zero) * scale per group of in / groups columns (fp32 math),
    as ``dtype``; zero None: 8 (symmetric)."""
    out, cols = codes.shape
    groups = scale.shape[1]
    centred = codes.float().reshape(out, groups, cols // groups)
    centred = centred - (8 if zero is None else zero.float().unsqueeze(-1))
    return (centred * scale.float().unsqueeze(-1)).reshape(out, cols).to(dtype)


def skinny_linear_w4(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x @ dequantize_w4(...).T (+ bias), in fp32, as x's dtype: what skinny_linear_w4 computes (its sums run
    per group, then scaled, so they differ from this in rounding only)."""
    y = x.float() @ dequantize_w4(codes, scale, zero, torch.float32).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row symmetric int8 activations: (q int8 [rows, in], t fp32 [rows, 1]), x ~ q * t, t = max|x| /
    127 (1 for a zero row), q = round(x * (1 / t)) to nearest even."""
    top = x.float().abs().amax(dim=1, keepdim=True)
    t = torch.where(top > 0, top / 127, torch.ones_like(top))
    return (x.float() * (1 / t)).round().clamp(-127, 127).to(torch.int8), t


def pack_linear_weight_w8a8(q: torch.Tensor, panel: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [out, in] -> (panels [ceil(out / panel), ceil(in / 4), 4 * panel]: 4 k per column interleaved, zero
    padded; each column's 128 * sum_k q (fp32 [out]): the offset term of x's unsigned bytes)."""
    out_features, in_features = q.shape
    panels, k4 = -(-out_features // panel), -(-in_features // 4) * 4
    padded = torch.nn.functional.pad(q, (0, k4 - in_features, 0, panels * panel - out_features))
    packed = padded.view(panels, panel, k4 // 4, 4).permute(0, 2, 1, 3).reshape(panels, k4 // 4, 4 * panel)
    return packed.contiguous(), q.sum(1, dtype=torch.int32).float() * 128


def skinny_linear_w8a8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, col_offset: torch.Tensor,
                       bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """(quantize_rows(x) @ q.T) * t * scale (+ bias), q unpacked from pack_linear_weight_w8a8's layout; the
    integer sums exact (float64), the result in x's dtype."""
    panels, quads, width = packed.shape
    q = packed.view(panels, quads, width // 4, 4).permute(0, 2, 1, 3).reshape(-1, quads * 4)
    xq, t = quantize_rows(x)
    sums = xq.double() @ q[:out_features, :x.shape[1]].double().t()
    y = (sums * t.double() * scale.double()).float()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def skinny_linear_argmax(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                         out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """skinny_linear's y widened to fp32 (bf16 layers: their rounded values) and each row's argmax (the
    compiled op takes it inside the GEMM)."""
    y = skinny_linear(x, packed, bias, out_features).float()
    return y, row_argmax(y)


def paged_attention_split(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    partition_size: int = 512,
) -> None:
    """paged_attention as the split CUDA op computes it: a decode row (query length 1) in context partitions of
    ``partition_size`` tokens, each giving (max, sum-exp, normalised partial out), merged after; longer rows as
    paged_attention (the prefill kernel's tiles only reorder an exact online softmax)."""
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        if q1 - q0 == 1:
            k = gather_kv(key_cache, block_tables[b], seq_len, key_scale)
            v = gather_kv(value_cache, block_tables[b], seq_len, value_scale)
            out[q0] = split_decode_row(query[q0], k, v, scale, sliding_window, softcap, partition_size,
                                       sinks).to(out.dtype)
        elif q1 > q0:
            one = torch.tensor([0, q1 - q0], dtype=query_start_loc.dtype, device=query_start_loc.device)
            paged_attention(out[q0:q1], query[q0:q1], key_cache, value_cache, block_tables[b:b + 1],
                            seq_lens[b:b + 1], one, q1 - q0, seq_len, scale, sliding_window, softcap,
                            key_scale, value_scale, sinks)


def split_decode_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int,
                     softcap: float, partition_size: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One decode row q [Hq, D] over dense k / v [Hkv, seq_len, D], fp32 [Hq, D]. Partitions wholly before the
    window are skipped; the others each see their keys in [first, seq_len). Sinks join at the merge."""
    seq_len, group = k.shape[1], q.shape[0] // k.shape[0]
    first = max(0, seq_len - sliding_window) if sliding_window else 0
    maxes, sums, partials = [], [], []
    for p in range(first // partition_size, -(-seq_len // partition_size)):
        lo, hi = max(p * partition_size, first), min((p + 1) * partition_size, seq_len)
        kp = k[:, lo:hi].repeat_interleave(group, dim=0).float()  # [Hq, n, D]
        vp = v[:, lo:hi].repeat_interleave(group, dim=0).float()
        scores = soft_cap((kp @ (q.float() * scale)[:, :, None])[:, :, 0], softcap)  # [Hq, n]
        m = scores.max(dim=-1).values
        e = (scores - m[:, None]).exp()
        maxes.append(m)
        sums.append(e.sum(dim=-1))
        partials.append((e[:, None] @ vp)[:, 0] / sums[-1][:, None])
    if len(partials) == 1 and sinks is None:  # the kernel writes a lone partition directly
        return partials[0]
    return merge_partitions(torch.stack(maxes), torch.stack(sums), torch.stack(partials), sinks)


def merge_partitions(maxes: torch.Tensor, sums: torch.Tensor, partials: torch.Tensor,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The merge kernel: partitions' maxes / sums [P, Hq] and normalised outs [P, Hq, D] -> [Hq, D]; a head's
    sink logit joins the max and the denominator."""
    sink = torch.full_like(maxes[0], float("-inf")) if sinks is None else sinks.float()
    top = torch.maximum(maxes.max(dim=0).values, sink)
    weights = sums * (maxes - top).exp()  # each partition's share of the softmax mass
    total = weights.sum(dim=0) + (sink - top).exp()
    return (weights[:, :, None] * partials).sum(dim=0) / total[:, None]
