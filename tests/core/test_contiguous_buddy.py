"""The buddy allocator against a brute-force reference: which aligned runs are free."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.baselines.buddy import BuddyAllocator, order_of

from .helpers import arena_decomposition


def _reference_fits(used: set[int], num_blocks: int, order: int) -> bool:
    """Is some aligned span of 2**order blocks, inside one decomposition chunk, all free?"""
    size = 1 << order
    for start, chunk in arena_decomposition(num_blocks):
        for s in range(start, start + chunk - size + 1, size):
            if not any(b in used for b in range(s, s + size)):
                return True
    return False


def _check_partition(arena: BuddyAllocator) -> None:
    runs = arena.free_runs() + arena.used_runs()
    covered = sorted(b for s, n in runs for b in range(s, s + n))
    assert covered == list(range(arena.num_blocks)), "free and used runs must tile the arena exactly"
    for start, n in runs:
        assert start % n == 0, f"run {start}+{n} is not aligned"
    assert arena.num_free_blocks == sum(n for _, n in arena.free_runs())


def test_order_of_rounds_up_to_a_power_of_two():
    assert [order_of(n) for n in (1, 2, 3, 4, 5, 16, 17)] == [0, 1, 2, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        order_of(0)


def test_arena_starts_as_its_binary_decomposition():
    arena = BuddyAllocator(300)
    assert arena.free_runs() == [(0, 256), (256, 32), (288, 8), (296, 4)]
    assert arena.largest_run == 256


def test_split_then_merge_restores_the_whole_run():
    arena = BuddyAllocator(16)
    a = arena.allocate(order_of(3))  # 4 blocks: splits 16 -> 8 + 4 + 4
    b = arena.allocate(0)
    assert (a, b) == (0, 4)
    assert arena.free_runs() == [(5, 1), (6, 2), (8, 8)]
    arena.free(a)
    arena.free(b)
    assert arena.free_runs() == [(0, 16)] and arena.num_free_blocks == 16


def test_scattered_free_blocks_cannot_serve_a_larger_run():
    arena = BuddyAllocator(8)
    starts = [arena.allocate(1) for _ in range(4)]
    arena.free(starts[0])
    arena.free(starts[2])
    assert arena.num_free_blocks == 4 and not arena.can_allocate(2)
    assert arena.free_runs() == [(0, 2), (4, 2)]
    with pytest.raises(RuntimeError, match="no free run"):
        arena.allocate(2)


def test_double_free_is_refused():
    arena = BuddyAllocator(4)
    start = arena.allocate(1)
    arena.free(start)
    with pytest.raises(RuntimeError, match="does not start an allocated run"):
        arena.free(start)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 70),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 1000)), max_size=60))
def test_buddy_matches_the_reference_and_frees_everything(num_blocks, ops):
    arena = BuddyAllocator(num_blocks)
    used: dict[int, int] = {}  # start -> size
    for is_alloc, order, pick in ops:
        if is_alloc or not used:
            taken = {b for s, n in used.items() for b in range(s, s + n)}
            assert arena.can_allocate(order) == _reference_fits(taken, num_blocks, order)
            if not arena.can_allocate(order):
                continue
            start = arena.allocate(order)
            assert not taken & set(range(start, start + (1 << order))), "runs overlap"
            used[start] = 1 << order
        else:
            start = sorted(used)[pick % len(used)]
            arena.free(start)
            del used[start]
        _check_partition(arena)
    for start in list(used):
        arena.free(start)
    assert arena.free_runs() == arena_decomposition(num_blocks) and arena.num_free_blocks == num_blocks
