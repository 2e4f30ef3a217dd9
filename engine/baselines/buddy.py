"""A binary buddy allocator over the block ids of one contiguous KV arena.

Runs are aligned power-of-two spans of block ids: a run of order k starts at a
multiple of 2**k and covers 2**k consecutive blocks. A request is rounded up
to the next power of two, a larger free run is split in halves until it fits,
and a freed run merges with its buddy (``start ^ 2**k``) whenever the buddy is
free and of the same order. An arena whose size is not a power of two starts
as its binary decomposition (e.g. 300 = 256 + 32 + 8 + 4), whose runs can
never merge past the end because no run reaching past it is ever free.
"""
from __future__ import annotations


def order_of(num_blocks: int) -> int:
    """Smallest k with 2**k >= num_blocks."""
    if num_blocks < 1:
        raise ValueError(f"a run holds at least one block, got {num_blocks}")
    return (num_blocks - 1).bit_length()


class BuddyAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.max_order = max(num_blocks.bit_length() - 1, 0)
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]  # per order: run starts
        self._used: dict[int, int] = {}  # run start -> order
        self.num_free_blocks = num_blocks
        start = 0
        for k in range(self.max_order, -1, -1):
            if num_blocks >> k & 1:
                self._free[k].add(start)
                start += 1 << k

    @property
    def largest_run(self) -> int:
        """Blocks of the largest run this arena can ever hand out."""
        return 1 << self.max_order if self.num_blocks else 0

    def can_allocate(self, order: int) -> bool:
        return any(self._free[k] for k in range(order, self.max_order + 1))

    def allocate(self, order: int) -> int:
        """Start block of a free run of 2**order blocks (lowest address among
        the smallest free runs that fit, so big runs stay whole)."""
        k = next((k for k in range(order, self.max_order + 1) if self._free[k]), None)
        if k is None:
            raise RuntimeError(f"no free run of {1 << order} blocks in the KV arena")
        start = min(self._free[k])
        self._free[k].remove(start)
        while k > order:  # split: keep the lower half, free the upper one
            k -= 1
            self._free[k].add(start + (1 << k))
        self._used[start] = order
        self.num_free_blocks -= 1 << order
        return start

    def free(self, start: int) -> None:
        order = self._used.pop(start, None)
        if order is None:
            raise RuntimeError(f"block {start} does not start an allocated run")
        self.num_free_blocks += 1 << order
        while order < self.max_order and (buddy := start ^ (1 << order)) in self._free[order]:
            self._free[order].remove(buddy)
            start = min(start, buddy)
            order += 1
        self._free[order].add(start)

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, num_blocks) of every free run, by address."""
        return sorted((s, 1 << k) for k, starts in enumerate(self._free) for s in starts)

    def used_runs(self) -> list[tuple[int, int]]:
        """(start, num_blocks) of every allocated run, by address."""
        return sorted((s, 1 << k) for s, k in self._used.items())
