"""The split (flash-decoding) attention: its pure-torch model of the CUDA kernels' partition / merge arithmetic
against the reference paged_attention, and the compiled op against the reference (on a GPU)."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import HEAD_SIZES, reference
from engine.config import EngineConfig

from .paged_batch import DEVICES, make_batch

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
BLOCK = 16


def lengths_around(partition: int) -> list[int]:
    """1, a block's edges, a partition's edges, three partitions and a bit, and a long context."""
    return [1, BLOCK - 1, BLOCK, BLOCK + 1, partition - 1, partition, partition + 1, 3 * partition + 5, 2100]


def split_and_reference(batch, window: int, partition: int, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full_like(batch.query, float("nan"))
    expected = torch.full_like(out, float("nan"))
    reference.paged_attention_split(*batch.attention_args(out), window, softcap, partition_size=partition)
    reference.paged_attention(*batch.attention_args(expected), window, softcap)
    return out, expected


@pytest.mark.parametrize("partition", [16, 64, 512])
@pytest.mark.parametrize("window", [0, 1, 7, 100, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partition_merge_matches_reference(partition, window, dtype):
    lengths = lengths_around(partition)
    batch = make_batch(lengths, [1] * len(lengths), 8, 2, 64, BLOCK, dtype, seed=partition + window)
    out, expected = split_and_reference(batch, window, partition)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("window", [0, 100])
def test_partition_merge_with_softcap(window):
    lengths = lengths_around(64)
    batch = make_batch(lengths, [1] * len(lengths), 8, 2, 64, BLOCK, torch.float32, seed=window)
    batch.query.mul_(8.0)
    out, expected = split_and_reference(batch, window, 64, softcap=3.0)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("kv_heads, ratio", [(1, 1), (2, 4), (1, 7), (2, 8), (1, 16)])
def test_every_head_size_and_gqa_ratio(head_size, kv_heads, ratio):
    lengths = [3, 64, 65, 200]
    batch = make_batch(lengths, [1] * len(lengths), kv_heads * ratio, kv_heads, head_size, BLOCK, torch.float32)
    out, expected = split_and_reference(batch, 0, 64)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_prefill_rows_beside_decode_rows():
    batch = make_batch([1, 40, 300, 37, 9], [1, 1, 20, 37, 0], 4, 2, 128, BLOCK, torch.float32)
    out, expected = split_and_reference(batch, 0, 64)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_large_logits_merge_without_overflow():
    batch = make_batch([700, 1300], [1, 1], 8, 2, 128, BLOCK, torch.float32)
    batch.query.mul_(40.0)
    out, expected = split_and_reference(batch, 0, 128)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_merge_weights_partitions_by_their_mass():
    # two partitions, one with all the mass: the merge returns its partial out
    maxes, sums = torch.tensor([[0.0], [-200.0]]), torch.tensor([[3.0], [5.0]])
    partials = torch.tensor([[[1.0, 2.0]], [[-9.0, 9.0]]])
    torch.testing.assert_close(reference.merge_partitions(maxes, sums, partials), torch.tensor([[1.0, 2.0]]))


def test_attention_kernel_picks_the_op(ext_ops):
    assert cuda_ext.load_ops("torch", "split").paged_attention is reference.paged_attention_split
    assert cuda_ext.load_ops("ext", "split").paged_attention is torch.ops.pagedserve.paged_attention_split
    assert cuda_ext.load_ops("ext").paged_attention is torch.ops.pagedserve.paged_attention
    with pytest.raises(ValueError, match="attention_kernel"):
        cuda_ext.load_ops("torch", "fast")
    with pytest.raises(ValueError, match="attention_kernel"):
        EngineConfig(attention_kernel="fast")


def test_cpu_split_op_runs_the_cpu_kernel(ext_ops):
    batch = make_batch([1, 600, 90], [1, 1, 30], 8, 2, 64, BLOCK, torch.float32)
    out, expected = torch.full_like(batch.query, float("nan")), torch.full_like(batch.query, float("nan"))
    torch.ops.pagedserve.paged_attention_split(*batch.attention_args(out), 7)
    reference.paged_attention(*batch.attention_args(expected), 7)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


CUDA = [p for p in DEVICES if not isinstance(p, str)]


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("op", ["paged_attention", "paged_attention_split"])
@pytest.mark.parametrize("window", [0, 5, 600])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_cuda_ops_match_reference(ext_ops, device, op, window, head_size):
    """Both CUDA kernels on decode rows around partition edges, mixed with prefill and chunked-prefill rows."""
    lengths = [*lengths_around(512), 1, 48, 300]
    q_lens = [1] * (len(lengths) - 3) + [1, 48, 70]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for kv_heads, ratio in [(2, 1), (2, 7), (1, 8), (1, 16)]:
            batch = make_batch(lengths, q_lens, kv_heads * ratio, kv_heads, head_size, BLOCK, dtype, device)
            out = torch.full_like(batch.query, float("nan"))
            expected = torch.full_like(out, float("nan"))
            getattr(torch.ops.pagedserve, op)(*batch.attention_args(out), window)
            reference.paged_attention(*batch.attention_args(expected), window)
            torch.testing.assert_close(out, expected, **TOL[dtype], msg=lambda m: f"{op} {dtype} {ratio}: {m}")


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("op", ["paged_attention", "paged_attention_split"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("head_size", [64, 256])
def test_cuda_softcap_matches_reference(ext_ops, device, op, window, head_size):
    """Both CUDA kernels with Gemma 2's logit soft-capping: decode rows over partitions, prefill tiles."""
    lengths, q_lens = [1, 600, 1300, 48, 300], [1, 1, 1, 48, 70]
    for dtype in (torch.float32, torch.bfloat16):
        batch = make_batch(lengths, q_lens, 8, 2, head_size, BLOCK, dtype, device)
        batch.query.mul_(8.0)
        out = torch.full_like(batch.query, float("nan"))
        expected = torch.full_like(out, float("nan"))
        getattr(torch.ops.pagedserve, op)(*batch.attention_args(out), window, 4.0)
        reference.paged_attention(*batch.attention_args(expected), window, 4.0)
        torch.testing.assert_close(out, expected, **TOL[dtype], msg=lambda m: f"{op} {dtype}: {m}")


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_cuda_split_every_block_size(ext_ops, device, block_size):
    lengths = [1, block_size + 1, 513, 1100, 3 * block_size - 1]
    for dtype in (torch.float32, torch.bfloat16):
        batch = make_batch(lengths, [1, 1, 1, 40, 3 * block_size - 1], 8, 2, 128, block_size, dtype, device)
        out = torch.full_like(batch.query, float("nan"))
        expected = torch.full_like(out, float("nan"))
        torch.ops.pagedserve.paged_attention_split(*batch.attention_args(out))
        reference.paged_attention(*batch.attention_args(expected))
        torch.testing.assert_close(out, expected, **TOL[dtype])
