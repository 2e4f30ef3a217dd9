"""reshape_and_cache, copy_blocks and swap_blocks (compiled) against the reference."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference

from .paged_batch import DEVICES, LAYER, NUM_LAYERS


def dtypes_for(device: str) -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16] + ([torch.float16] if device == "cuda" else [])


def random_pool(num_blocks: int, dtype: torch.dtype, device: str, seed: int, kv_heads: int = 2,
                block_size: int = 16, head_size: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, NUM_LAYERS, 2, kv_heads, block_size, head_size)
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def random_mapping(num_src: int, num_dst: int, n: int, seed: int) -> torch.Tensor:
    """n (src, dst) pairs with distinct destinations."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_src, (n,), generator=gen)
    dst = torch.randperm(num_dst, generator=gen)[:n]
    return torch.stack([src, dst], dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("head_size", [64, 80, 256])
@pytest.mark.parametrize("num_tokens", [1, 37, 300])
def test_reshape_and_cache(ext_ops, device, block_size, head_size, num_tokens):
    for seed, dtype in enumerate(dtypes_for(device)):
        cache = random_pool(-(-num_tokens // block_size) + 4, dtype, device, seed, 3, block_size, head_size)
        expected = cache.clone()
        gen = torch.Generator().manual_seed(seed)
        slots = torch.randperm(cache.shape[0] * block_size, generator=gen)[:num_tokens]
        slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1  # padding tokens
        # key/value sliced out of a fused qkv projection: strided rows
        qkv = torch.randn(num_tokens, 9 * head_size, generator=gen).to(dtype=dtype, device=device)
        key = qkv[:, 3 * head_size : 6 * head_size].view(num_tokens, 3, head_size)
        value = qkv[:, 6 * head_size :].view(num_tokens, 3, head_size)
        args = (key, value, slots.to(device))
        ext_ops.reshape_and_cache(args[0], args[1], cache[:, LAYER, 0], cache[:, LAYER, 1], args[2])
        reference.reshape_and_cache(args[0], args[1], expected[:, LAYER, 0], expected[:, LAYER, 1], args[2])
        assert torch.equal(cache, expected)


def test_reshape_and_cache_rejects_bad_slots_and_dtypes(ext_ops):
    cache = random_pool(2, torch.float32, "cpu", 0)
    key = torch.randn(3, 2, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        ext_ops.reshape_and_cache(key, key, cache[:, 0, 0], cache[:, 0, 1], torch.tensor([0, 1, 32]))
    with pytest.raises(RuntimeError, match="dtype"):
        ext_ops.reshape_and_cache(key.bfloat16(), key.bfloat16(), cache[:, 0, 0], cache[:, 0, 1], torch.arange(3))
    with pytest.raises(RuntimeError, match="int64"):
        ext_ops.reshape_and_cache(key, key, cache[:, 0, 0], cache[:, 0, 1], torch.arange(3, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_pairs", [0, 1, 9])
def test_copy_blocks_moves_whole_blocks_of_all_layers(ext_ops, device, num_pairs):
    for seed, dtype in enumerate(dtypes_for(device)):
        cache = random_pool(20, dtype, device, seed)
        expected = cache.clone()
        # sources and destinations disjoint, as copy-on-write produces them
        mapping = random_mapping(10, 10, num_pairs, seed)
        mapping[:, 1] += 10
        ext_ops.copy_blocks(cache, mapping.to(device))
        reference.copy_blocks(expected, mapping)
        assert torch.equal(cache, expected)


def test_copy_blocks_rejects_bad_mapping(ext_ops):
    cache = random_pool(4, torch.float32, "cpu", 0)
    with pytest.raises(RuntimeError, match="out of range"):
        ext_ops.copy_blocks(cache, torch.tensor([[0, 4]]))
    with pytest.raises(RuntimeError, match=r"\[num_pairs, 2\]"):
        ext_ops.copy_blocks(cache, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="contiguous"):
        ext_ops.copy_blocks(cache[:, 1:], torch.tensor([[0, 1]]))


@pytest.mark.parametrize("direction", ["to_cpu_pool", "from_cpu_pool"])
@pytest.mark.parametrize("device", DEVICES)
def test_swap_blocks(ext_ops, device, direction):
    for seed, dtype in enumerate(dtypes_for(device)):
        device_pool, cpu_pool = random_pool(12, dtype, device, seed), random_pool(7, dtype, "cpu", seed + 1)
        if device == "cuda":
            cpu_pool = cpu_pool.pin_memory()
        src, dst = (device_pool, cpu_pool) if direction == "to_cpu_pool" else (cpu_pool, device_pool)
        mapping = random_mapping(src.shape[0], dst.shape[0], 5, seed)
        expected = dst.clone()
        ext_ops.swap_blocks(src, dst, mapping)
        if device == "cuda":
            torch.cuda.synchronize()
        reference.swap_blocks(src, expected, mapping)
        assert torch.equal(dst, expected)


def test_swap_blocks_rejects_mismatched_pools(ext_ops):
    with pytest.raises(RuntimeError, match="differ"):
        ext_ops.swap_blocks(random_pool(3, torch.float32, "cpu", 0), random_pool(3, torch.bfloat16, "cpu", 0),
                            torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="differ"):
        ext_ops.swap_blocks(random_pool(3, torch.float32, "cpu", 0, head_size=80),
                            random_pool(3, torch.float32, "cpu", 0), torch.tensor([[0, 1]]))


def test_load_ops():
    assert cuda_ext.load_ops("torch").paged_attention is reference.paged_attention
    with pytest.raises(ValueError, match="backend"):
        cuda_ext.load_ops("triton")


def test_ext_is_built_after_loading(ext_ops):
    assert cuda_ext.is_built()
    assert ext_ops.swap_blocks is torch.ops.pagedserve.swap_blocks
