"""paged_attention's attention sinks (gpt-oss: one logit per query head that joins the softmax's denominator
only): the reference against transformers' eager formula on dense K/V, and the compiled ops (simple and split,
CPU and CUDA) against the reference, with GQA, mixed lengths and sliding windows."""

from __future__ import annotations

import random

import pytest
import torch

from cuda_ext import reference

from .paged_batch import DEVICES, PagedBatch, make_batch

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
OPS = ["paged_attention", "paged_attention_split"]


def sinks_for(batch: PagedBatch, seed: int, spread: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch.query.shape[1], generator=gen) * spread).to(batch.query.device)


def eager(batch: PagedBatch, sinks: torch.Tensor, window: int) -> torch.Tensor:
    """transformers' GptOss eager attention per sequence: the sink appended to the masked scores, the max
    subtracted, softmax, the sink's column dropped."""
    outs, starts = [], batch.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.query[starts[b]:starts[b + 1]].float().transpose(0, 1)  # [Hq, q_len, D]
        group = q.shape[0] // k.shape[1]
        k, v = (x.float().transpose(0, 1).repeat_interleave(group, dim=0) for x in (k, v))
        rows, keys = torch.arange(len(batch.keys[b]) - q.shape[1], len(batch.keys[b]))[:, None], torch.arange(len(k[0]))
        hidden = (keys > rows) | ((rows - keys >= window) if window else False)
        scores = (q @ k.transpose(1, 2) * batch.scale).masked_fill(hidden, float("-inf"))
        logits = torch.cat((scores, sinks.float().view(-1, 1, 1).expand(-1, q.shape[1], 1)), dim=-1)
        probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
        outs.append((probs @ v).transpose(0, 1))
    return torch.cat(outs)


def random_batch(seed: int, decode: bool, dtype: torch.dtype, device: str = "cpu") -> PagedBatch:
    rng = random.Random(seed)
    kv_heads, ratio = rng.choice([(1, 1), (2, 2), (1, 7), (2, 4), (1, 8)])
    seq_lens = [rng.choice([1, 17, 64, 129, rng.randrange(2, 700)]) for _ in range(rng.choice([1, 3, 5]))]
    q_lens = [1 if decode else rng.randint(1, n) for n in seq_lens]
    return make_batch(seq_lens, q_lens, kv_heads * ratio, kv_heads, 64, rng.choice([8, 16, 32]), dtype, device,
                      seed=seed)


@pytest.mark.parametrize("window", [0, 1, 13, 100])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "varlen"])
def test_reference_matches_eager_formula(window, decode):
    batch = random_batch(window * 2 + decode, decode, torch.float32)
    sinks = sinks_for(batch, window)
    out = torch.full_like(batch.query, float("nan"))
    reference.paged_attention(*batch.attention_args(out), window, 0.0, sinks=sinks)
    torch.testing.assert_close(out, eager(batch, sinks, window), **TOL[torch.float32])


@pytest.mark.parametrize("partition", [16, 64, 512])
@pytest.mark.parametrize("window", [0, 7, 100])
def test_split_reference_merges_the_sink(partition, window):
    lengths = [1, 15, 16, 17, partition - 1, partition + 1, 3 * partition + 5]
    batch = make_batch(lengths, [1] * len(lengths), 8, 2, 64, 16, torch.float32, seed=partition + window)
    sinks = sinks_for(batch, partition)
    out, expected = torch.full_like(batch.query, float("nan")), torch.full_like(batch.query, float("nan"))
    reference.paged_attention_split(*batch.attention_args(out), window, 0.0, sinks=sinks, partition_size=partition)
    reference.paged_attention(*batch.attention_args(expected), window, 0.0, sinks=sinks)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "varlen"])
@pytest.mark.parametrize("seed", range(6))
def test_compiled_matches_reference(ext_ops, device, op, decode, seed):
    window = random.Random(seed).choice([0, 0, 1, 12, 40, 300])
    for dtype in (torch.float32, torch.bfloat16):
        batch = random_batch(50 + seed * 2 + decode, decode, dtype, device)
        sinks = sinks_for(batch, seed)
        out, expected = torch.full_like(batch.query, float("nan")), torch.full_like(batch.query, float("nan"))
        getattr(torch.ops.pagedserve, op)(*batch.attention_args(out), window, 0.0, None, None, sinks)
        reference.paged_attention(*batch.attention_args(expected), window, 0.0, sinks=sinks)
        torch.testing.assert_close(out, expected, **TOL[dtype], msg=lambda m: f"window {window} {dtype}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_sink_extremes(ext_ops, device, op):
    """A sink far below every score changes nothing; one far above takes all the mass (zero rows, no overflow)."""
    lengths = [1, 40, 600]
    batch = make_batch(lengths, [1, 40, 3], 4, 2, 64, 16, torch.float32, device, seed=3)
    attend = getattr(torch.ops.pagedserve, op)
    plain, low, high = (torch.full_like(batch.query, float("nan")) for _ in range(3))
    attend(*batch.attention_args(plain))
    attend(*batch.attention_args(low), sinks=torch.full((4,), -1e4, device=device))
    attend(*batch.attention_args(high), sinks=torch.full((4,), 1e4, device=device))
    torch.testing.assert_close(low, plain, rtol=0, atol=0)
    torch.testing.assert_close(high, torch.zeros_like(high), rtol=0, atol=0)


@pytest.mark.parametrize("sinks", [torch.zeros(3), torch.zeros(4, dtype=torch.float64), torch.zeros(2, 2)])
def test_bad_sinks_rejected(ext_ops, sinks):
    batch = make_batch([5], [5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="sinks must be contiguous float32 \\[num_heads=4\\]"):
        ext_ops.paged_attention(*batch.attention_args(torch.empty_like(batch.query)), sinks=sinks)
