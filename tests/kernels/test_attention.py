"""paged_attention (compiled) against the pure-torch reference, and the reference
against torch SDPA on dense K/V."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from cuda_ext import HEAD_SIZES, reference

from .paged_batch import DEVICES, make_batch

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def dtypes_for(device: str) -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16] + ([torch.float16] if device == "cuda" else [])


def run_both(ext_ops, batch, sliding_window: int = 0, softcap: float = 0.0):
    out = torch.full_like(batch.query, float("nan")).contiguous()
    expected = torch.full_like(out, float("nan"))
    ext_ops.paged_attention(*batch.attention_args(out), sliding_window, softcap)
    reference.paged_attention(*batch.attention_args(expected), sliding_window, softcap)
    return out, expected


def random_case(rng: random.Random, decode: bool) -> dict:
    """A random shape covering odd lengths, block multiples, single tokens and GQA 1/2/7/8."""
    block_size = rng.choice([8, 16, 32, 64, 128])
    kv_heads, ratio = rng.choice([(1, 1), (2, 1), (2, 2), (1, 7), (2, 7), (1, 8)])
    seq_lens = []
    for _ in range(rng.choice([1, 3, 6])):
        kind = rng.choice(["odd", "multiple", "single", "long"])
        seq_lens.append({"odd": rng.randrange(1, 300) | 1, "multiple": block_size * rng.randint(1, 4),
                         "single": 1, "long": rng.randrange(300, 700)}[kind])
    q_lens = [1 if decode else rng.randint(1, n) for n in seq_lens]
    return dict(seq_lens=seq_lens, q_lens=q_lens, num_heads=kv_heads * ratio, num_kv_heads=kv_heads,
                head_size=rng.choice(HEAD_SIZES), block_size=block_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "varlen"])
@pytest.mark.parametrize("seed", range(12))
def test_matches_reference_on_random_shapes(ext_ops, device, decode, seed):
    case = random_case(random.Random(seed * 2 + decode), decode)
    for dtype in dtypes_for(device):
        batch = make_batch(**case, dtype=dtype, device=device, seed=seed)
        out, expected = run_both(ext_ops, batch)
        torch.testing.assert_close(out, expected, **TOL[dtype], msg=lambda m: f"{case} {dtype}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "varlen"])
@pytest.mark.parametrize("seed", range(6))
def test_sliding_window_matches_reference(ext_ops, device, decode, seed):
    """Windows shorter than a block, than a chunk, across many blocks, and longer than every sequence."""
    rng = random.Random(100 + seed * 2 + decode)
    case = random_case(rng, decode)
    window = rng.choice([1, 5, case["block_size"], 100, 1000])
    for dtype in dtypes_for(device):
        batch = make_batch(**case, dtype=dtype, device=device, seed=seed)
        out, expected = run_both(ext_ops, batch, window)
        torch.testing.assert_close(out, expected, **TOL[dtype], msg=lambda m: f"{case} window {window} {dtype}: {m}")


@pytest.mark.parametrize("window", [1, 12, 24])
def test_sliding_window_prefill_tiles(ext_ops, window):
    """Whole prefills in 32-token tiles of GQA pairs: a row's window starts mid-chunk, at any lane (once
    written past its row, corrupting the next row's scores and the heap)."""
    lengths = [70, 33, 90, 17, 64, 5]
    batch = make_batch(lengths, lengths, 2, 1, 64, 16, torch.float32, seed=window)
    out, expected = run_both(ext_ops, batch, window)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("ratio", [1, 2, 7, 8])
def test_every_head_size_and_gqa_ratio(ext_ops, device, head_size, ratio):
    # decode rows and a chunked-prefill chunk after a cached prefix in one batch
    for dtype in dtypes_for(device):
        batch = make_batch([1, 16, 37, 64], [1, 1, 9, 64], 2 * ratio, 2, head_size, 16, dtype, device)
        out, expected = run_both(ext_ops, batch)
        torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_every_block_size(ext_ops, block_size):
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1]
    batch = make_batch(lengths, [1, block_size, 2, 3 * block_size - 1], 4, 2, 64, block_size, torch.float32)
    out, expected = run_both(ext_ops, batch)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_large_logits_are_stable(ext_ops):
    # scores in the hundreds: a naive exp overflows, the online softmax must not
    batch = make_batch([300, 77], [1, 20], 8, 2, 128, 16, torch.float32)
    batch.query.mul_(40.0)
    out, expected = run_both(ext_ops, batch)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_sequence_without_query_rows(ext_ops):
    batch = make_batch([20, 5], [0, 5], 4, 2, 64, 16, torch.float32)
    out, expected = run_both(ext_ops, batch)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_rows_past_the_last_sequence_are_untouched(ext_ops):
    batch = make_batch([9, 30], [2, 3], 4, 2, 64, 16, torch.float32)
    batch.query = torch.cat([batch.query, torch.randn(4, 4, 64)])  # padded batch: 4 rows no sequence owns
    out, expected = torch.full_like(batch.query, 7.0), torch.full_like(batch.query, 7.0)
    ext_ops.paged_attention(*batch.attention_args(out))
    reference.paged_attention(*batch.attention_args(expected))
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    assert (out[5:] == 7.0).all()


def test_writes_through_a_strided_out(ext_ops):
    batch = make_batch([40, 7], [3, 7], 8, 2, 64, 16, torch.bfloat16)
    fused = torch.zeros(10, 2 * 8 * 64, dtype=torch.bfloat16)
    out = fused[:, 64 * 8:].view(10, 8, 64)
    ext_ops.paged_attention(*batch.attention_args(out))
    expected = torch.empty(10, 8, 64, dtype=torch.bfloat16)
    reference.paged_attention(*batch.attention_args(expected))
    torch.testing.assert_close(out, expected, **TOL[torch.bfloat16])
    assert fused[:, : 64 * 8].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7, 40])
def test_reference_matches_sdpa_on_dense_kv(dtype, window):
    seq_lens, q_lens = [1, 33, 48, 129], [1, 33, 5, 1]
    batch = make_batch(seq_lens, q_lens, 14, 2, 64, 16, dtype)
    out = torch.empty_like(batch.query)
    reference.paged_attention(*batch.attention_args(out), window)
    starts = batch.query_start_loc.tolist()
    for b, (n, q_len) in enumerate(zip(seq_lens, q_lens)):
        q = batch.query[starts[b]:starts[b + 1]].float().transpose(0, 1)[None]
        k, v = (t.float().transpose(0, 1)[None] for t in (batch.keys[b], batch.values[b]))
        keys, positions = torch.arange(n)[None, :], torch.arange(n - q_len, n)[:, None]
        allowed = (keys <= positions) & ((keys > positions - window) if window else True)  # transformers' window
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=batch.scale, enable_gqa=True)
        torch.testing.assert_close(out[starts[b]:starts[b + 1]], dense[0].transpose(0, 1).to(dtype), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "varlen"])
@pytest.mark.parametrize("seed", range(4))
def test_softcap_matches_reference(ext_ops, device, decode, seed):
    """Gemma 2's logit soft-capping, with and without a window; queries scaled up so the cap bites."""
    rng = random.Random(200 + seed * 2 + decode)
    case = random_case(rng, decode)
    window, softcap = rng.choice([0, 0, 5, 100]), rng.choice([1.0, 4.0, 50.0])
    for dtype in dtypes_for(device):
        batch = make_batch(**case, dtype=dtype, device=device, seed=seed)
        batch.query.mul_(8.0)
        out, expected = run_both(ext_ops, batch, window, softcap)
        torch.testing.assert_close(out, expected, **TOL[dtype], msg=lambda m: f"{case} cap {softcap} {dtype}: {m}")


@pytest.mark.parametrize("window", [0, 7])
def test_reference_softcap_matches_eager_formula(window):
    """transformers' eager Gemma 2 attention: scores * scale, then cap * tanh(scores / cap), mask, softmax."""
    seq_lens, q_lens, softcap = [1, 33, 48], [1, 33, 5], 2.0
    batch = make_batch(seq_lens, q_lens, 4, 2, 64, 16, torch.float32)
    batch.query.mul_(8.0)
    out, uncapped = torch.empty_like(batch.query), torch.empty_like(batch.query)
    reference.paged_attention(*batch.attention_args(out), window, softcap)
    reference.paged_attention(*batch.attention_args(uncapped), window)
    starts = batch.query_start_loc.tolist()
    for b, (n, q_len) in enumerate(zip(seq_lens, q_lens)):
        q = batch.query[starts[b]:starts[b + 1]].transpose(0, 1)
        k, v = (t.transpose(0, 1).repeat_interleave(2, dim=0) for t in (batch.keys[b], batch.values[b]))
        scores = torch.tanh(q @ k.transpose(1, 2) * batch.scale / softcap) * softcap
        keys, positions = torch.arange(n)[None, :], torch.arange(n - q_len, n)[:, None]
        hidden = (keys > positions) | ((keys <= positions - window) if window else False)
        dense = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v
        torch.testing.assert_close(out[starts[b]:starts[b + 1]], dense.transpose(0, 1), **TOL[torch.float32])
    assert not torch.allclose(out, uncapped, **TOL[torch.float32])  # the cap changed the result


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(head_size=72), "unsupported head_size 72"),
        (dict(num_heads=3), "multiple"),
        (dict(q_lens=[9]), "seq_len"),
    ],
)
def test_bad_input_raises_clear_error(ext_ops, change, message):
    case = dict(seq_lens=[8], q_lens=[1], num_heads=4, num_kv_heads=2, head_size=64, block_size=8) | change
    batch = make_batch(**case, dtype=torch.float32)  # q_lens=[9]: seq_len 8 cannot hold a 9-token chunk
    with pytest.raises(RuntimeError, match=message):
        ext_ops.paged_attention(*batch.attention_args(torch.empty_like(batch.query)))


def test_every_head_size_of_real_checkpoints_is_compiled():
    assert {32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 256} <= set(HEAD_SIZES)


def test_rejects_query_start_loc_past_the_query(ext_ops):
    batch = make_batch([8, 8], [1, 1], 4, 2, 64, 8, torch.float32)
    batch.query_start_loc[-1] = 3
    with pytest.raises(RuntimeError, match="query_start_loc"):
        ext_ops.paged_attention(*batch.attention_args(torch.empty_like(batch.query)))


def test_rejects_a_negative_window(ext_ops):
    batch = make_batch([8], [1], 4, 2, 64, 8, torch.float32)
    with pytest.raises(RuntimeError, match="sliding_window must be >= 0"):
        ext_ops.paged_attention(*batch.attention_args(torch.empty_like(batch.query)), -1)


def test_rejects_a_negative_softcap(ext_ops):
    batch = make_batch([8], [1], 4, 2, 64, 8, torch.float32)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        ext_ops.paged_attention(*batch.attention_args(torch.empty_like(batch.query)), 0, -1.0)


def test_cpu_rejects_fp16_with_a_clear_error(ext_ops):
    batch = make_batch([8], [1], 4, 2, 64, 8, torch.float16)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        ext_ops.paged_attention(*batch.attention_args(torch.empty_like(batch.query)))


def test_rejects_dtype_mismatch_and_non_dense_cache(ext_ops):
    batch = make_batch([8], [1], 4, 2, 64, 8, torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        ext_ops.paged_attention(*batch.attention_args(torch.empty_like(batch.query, dtype=torch.bfloat16)))
    args = list(batch.attention_args(torch.empty_like(batch.query)))
    args[2] = args[2].transpose(2, 3)
    args[3] = args[3].transpose(2, 3)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext_ops.paged_attention(*args)
