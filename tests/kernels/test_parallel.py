"""csrc/cpu/parallel.h: the ops' parallel_for with helper threads (not OpenMP)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_an_error_in_any_chunk_reaches_the_caller_and_the_pool_goes_on(ext_ops, two_threads):
    """300 tokens are 5 chunks of 64 over 2 threads: the bad slot sits in the last one, whoever runs it."""
    cache = torch.zeros(40, 2, 16, 64)
    key = torch.randn(300, 2, 64)
    for _ in range(20):
        slots = torch.arange(300)
        slots[299] = 40 * 16
        with pytest.raises(RuntimeError, match="out of range"):
            ext_ops.reshape_and_cache(key, key, cache, cache.clone(), slots)
        good = torch.zeros(40, 2, 16, 64)
        ext_ops.reshape_and_cache(key, key, good, good.clone(), torch.arange(300))
        assert torch.equal(good.transpose(1, 2).reshape(-1, 2, 64)[:300], key)


def test_many_back_to_back_calls_match_one_thread(ext_ops, two_threads):
    """Jobs issued faster than a helper wakes: every chunk is done exactly once whoever claims it."""
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(3000, 128, generator=gen), torch.randn(17, 128, generator=gen)
    packed = torch.ops.pagedserve.pack_linear_weight(weight)
    torch.set_num_threads(1)
    expected = torch.ops.pagedserve.skinny_linear(x, packed, None, 3000)
    torch.set_num_threads(2)
    for _ in range(200):
        assert torch.equal(torch.ops.pagedserve.skinny_linear(x, packed, None, 3000), expected)
