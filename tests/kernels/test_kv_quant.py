"""Quantized KV caches (int8 / fp8 codes, a bf16 scale per slot and KV head): the compiled write and attention
against the pure-torch reference, the reference's quantization against exact fp32 attention, and block copies
that carry the scales."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from cuda_ext import reference

from .paged_batch import DEVICES, LAYER, PagedBatch, make_batch, slots_for
from .test_attention import TOL, random_case

CODE_DTYPES = [torch.int8, torch.float8_e4m3fn]
QUERY_DTYPES = [torch.float32, torch.bfloat16]
# Dequantised attention vs exact fp32 attention on randn K/V: int8 loses ~1/254 of a row's absmax per element,
# e4m3 ~1/16 of each element.
QUANT_ERROR = {torch.int8: 0.03, torch.float8_e4m3fn: 0.2}


@dataclass(slots=True)
class QuantizedKV:
    """A batch's K/V written quantized into all-layer pools laid out like the engine's."""

    codes: torch.Tensor  # [num_blocks, num_layers, 2, Hkv, block_size, D]
    scales: torch.Tensor  # [num_blocks, num_layers, 2, Hkv, block_size] bf16

    def caches(self) -> tuple[torch.Tensor, ...]:
        """key_cache, value_cache, key_scale, value_scale of the test layer."""
        return (self.codes[:, LAYER, 0], self.codes[:, LAYER, 1], self.scales[:, LAYER, 0], self.scales[:, LAYER, 1])


def batch_slots(batch: PagedBatch) -> torch.Tensor:
    block_size = batch.kv_cache.shape[4]
    return torch.tensor([s for b, k in enumerate(batch.keys)
                         for s in slots_for(batch.block_tables[b].tolist(), range(len(k)), block_size)])


def quantize_batch(batch: PagedBatch, dtype: torch.dtype, write=reference.reshape_and_cache) -> QuantizedKV:
    """The batch's K/V written by ``write`` into fresh pools whose other slots hold NaN scales, so a stray read
    poisons the result."""
    shape = batch.kv_cache.shape
    kv = QuantizedKV(torch.full(shape, 3, dtype=torch.int8).view(dtype),
                     torch.full(shape[:-1], float("nan"), dtype=torch.bfloat16))
    k_cache, v_cache, k_scale, v_scale = kv.caches()
    write(torch.cat(batch.keys), torch.cat(batch.values), k_cache, v_cache, batch_slots(batch), k_scale, v_scale)
    return kv


def attention(op, batch: PagedBatch, kv: QuantizedKV, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan")).contiguous()
    k_cache, v_cache, k_scale, v_scale = kv.caches()
    args = list(batch.attention_args(out))
    args[2:4] = k_cache, v_cache
    op(*args, window, softcap, key_scale=k_scale, value_scale=v_scale)
    return out


def codes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int8), b.view(torch.int8))


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_reshape_and_cache_matches_reference_bit_for_bit(ext_ops, code_dtype, dtype, block_size):
    batch = make_batch([1, 37, block_size + 3], [1, 1, 1], 4, 2, 64, block_size, dtype)
    ours = quantize_batch(batch, code_dtype, ext_ops.reshape_and_cache)
    expected = quantize_batch(batch, code_dtype)
    assert codes_equal(ours.codes, expected.codes)
    assert torch.equal(ours.scales.isnan(), expected.scales.isnan())  # untouched slots stay untouched
    assert torch.equal(ours.scales.nan_to_num(), expected.scales.nan_to_num())


def test_reshape_and_cache_skips_padding_and_reads_strided_rows(ext_ops):
    qkv = torch.randn(5, 4, 3, 64)
    key, value = qkv[:, :, 1], qkv[:, :, 2]  # rows and heads strided
    slots = torch.tensor([3, -1, 17, 0, -1])
    pools = [torch.zeros(4, 4, 8, 64, dtype=torch.int8) for _ in range(2)] + \
            [torch.zeros(4, 4, 8, dtype=torch.bfloat16) for _ in range(2)]
    expected = [p.clone() for p in pools]
    ext_ops.reshape_and_cache(key, value, pools[0], pools[1], slots, pools[2], pools[3])
    reference.reshape_and_cache(key, value, expected[0], expected[1], slots, expected[2], expected[3])
    assert all(torch.equal(a, b) for a, b in zip(pools, expected))
    assert pools[2].count_nonzero() == 3 * 4  # three slots written, every head


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_quantization_round_trip_error_is_bounded(code_dtype):
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0  # an all-zero row: scale 0, codes 0
    codes, scales = reference.quantize_kv(x, code_dtype)
    back = codes.float() * scales.float()[..., None]
    absmax = x.abs().amax(dim=-1, keepdim=True)
    if code_dtype == torch.int8:  # half a step of absmax / 127 (the bf16 scale rounds by < 2^-8)
        assert ((back - x).abs() <= absmax / 127 * 0.51).all()
    else:  # e4m3: 3 mantissa bits, and no element below the smallest subnormal step's half
        assert ((back - x).abs() <= x.abs() / 16 + absmax / 448 * 2.0**-9 * 1.01).all()
    assert (back[7, 1] == 0).all() and scales[7, 1] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "varlen"])
@pytest.mark.parametrize("seed", range(6))
def test_attention_matches_reference_on_random_shapes(ext_ops, device, decode, seed):
    """GQA, block sizes, head sizes, decode and varlen rows, sliding windows, soft-capped scores (Gemma 2: the
    dequantised keys' scores are capped); both ops over the same codes."""
    rng = random.Random(500 + seed * 2 + decode)
    case = random_case(rng, decode)
    window = rng.choice([0, 0, 5, case["block_size"], 100])
    softcap = 0.0 if seed % 2 else 0.5
    for dtype in QUERY_DTYPES:
        for code_dtype in CODE_DTYPES:
            batch = make_batch(**case, dtype=dtype, seed=seed)
            kv = quantize_batch(batch, code_dtype)
            batch.query, batch.block_tables = batch.query.to(device), batch.block_tables.to(device)
            batch.seq_lens, batch.query_start_loc = batch.seq_lens.to(device), batch.query_start_loc.to(device)
            kv = QuantizedKV(kv.codes.to(device), kv.scales.to(device))
            expected = attention(reference.paged_attention, batch, kv, window, softcap)
            for op in (ext_ops.paged_attention, torch.ops.pagedserve.paged_attention_split):
                torch.testing.assert_close(attention(op, batch, kv, window, softcap), expected, **TOL[dtype],
                                           msg=lambda m: f"{case} {dtype} {code_dtype} window {window} "
                                                         f"softcap {softcap}: {m}")


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (9, 0.0), (9, 0.5)])
def test_reference_split_model_reads_the_scales(code_dtype, window, softcap):
    lengths = [1, 15, 100, 700]
    batch = make_batch(lengths, [1, 1, 1, 3], 8, 2, 64, 16, torch.float32)
    kv = quantize_batch(batch, code_dtype)
    split = attention(lambda *a, **kw: reference.paged_attention_split(*a, **kw, partition_size=64), batch, kv,
                      window, softcap)
    torch.testing.assert_close(split, attention(reference.paged_attention, batch, kv, window, softcap),
                               **TOL[torch.float32])


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("window", [0, 24])
def test_dequantised_attention_is_close_to_exact_attention(code_dtype, window):
    lengths = [1, 33, 200, 129]
    batch = make_batch(lengths, [1, 33, 7, 1], 8, 2, 64, 16, torch.float32)
    quantized = attention(reference.paged_attention, batch, quantize_batch(batch, code_dtype), window)
    exact = torch.empty_like(batch.query)
    reference.paged_attention(*batch.attention_args(exact), window)
    error = (quantized - exact).abs().max().item()
    assert 0 < error < QUANT_ERROR[code_dtype]


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_copy_and_swap_of_both_pools_carry_the_scales(ext_ops, code_dtype):
    """A block copied (copy-on-write) or swapped out and back in with its scales attends as the original."""
    batch = make_batch([40], [1], 4, 2, 64, 16, torch.float32)
    kv = quantize_batch(batch, code_dtype)
    expected = attention(ext_ops.paged_attention, batch, kv)
    used = batch.block_tables[0, :3].long()
    free = torch.tensor([b for b in range(kv.codes.shape[0]) if b not in used.tolist()][:3])
    copies = torch.stack([used, free], dim=1)
    for pool in (kv.codes, kv.scales):
        ext_ops.copy_blocks(pool, copies)
    cpu = QuantizedKV(torch.empty_like(kv.codes), torch.empty_like(kv.scales))
    swap_out = torch.stack([free, torch.arange(3)], dim=1)
    swap_in = torch.stack([torch.arange(3), used], dim=1)
    for pool, swap_pool in ((kv.codes, cpu.codes), (kv.scales, cpu.scales)):
        ext_ops.swap_blocks(pool, swap_pool, swap_out)
        pool[used] = 0  # the originals are gone: only the round trip can restore them
        ext_ops.swap_blocks(swap_pool, pool, swap_in)
    torch.testing.assert_close(attention(ext_ops.paged_attention, batch, kv), expected, rtol=0, atol=0)
    batch.block_tables[0, :3] = free.int()
    torch.testing.assert_close(attention(ext_ops.paged_attention, batch, kv), expected, rtol=0, atol=0)


def test_bad_scales_raise_clear_errors(ext_ops):
    batch = make_batch([8], [1], 4, 2, 64, 8, torch.float32)
    kv = quantize_batch(batch, torch.int8)
    k_cache, v_cache, k_scale, v_scale = kv.caches()
    out = torch.empty_like(batch.query)
    args = list(batch.attention_args(out))
    with pytest.raises(RuntimeError, match="needs key_scale and value_scale"):
        ext_ops.paged_attention(*args[:2], k_cache, v_cache, *args[4:])
    with pytest.raises(RuntimeError, match="go together"):
        ext_ops.paged_attention(*args[:2], k_cache, v_cache, *args[4:], key_scale=k_scale)
    with pytest.raises(RuntimeError, match="takes no scales"):
        ext_ops.paged_attention(*args, key_scale=k_scale, value_scale=v_scale)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext_ops.paged_attention(*args[:2], k_cache, v_cache, *args[4:], key_scale=k_scale.float(),
                                value_scale=v_scale.float())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext_ops.reshape_and_cache(batch.keys[0], batch.values[0], k_cache, v_cache, torch.arange(8),
                                  k_scale[:, :1], v_scale[:, :1])

