"""A picture of the KV pools at one moment (the dashboard's): every block's state, ref count, owner and
fill, the requests holding blocks, and the engine's figures of the same moment.

Built on demand between steps from the allocator's own block state, never on a step's path. The
per-block fields are numpy arrays, one entry per block: a 100k-block pool is a few hundred kB on the
wire, not a list of per-block maps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from engine.stats import EngineStats

# Block states (PoolSnapshot.state).
FREE = 0  # empty, reused first
CACHED = 1  # free, but still holding a prefix a new request may hit (reused last, LRU)
USED = 2  # held by one sequence
SHARED = 3  # held by several (fork, n > 1, prefix hits), full: never written again
COW = 4  # held by several and partly filled: the next append by any but its last holder copies it
STATE_NAMES = ("free", "cached", "used", "shared", "cow")
NO_OWNER = 0xFFFF  # PoolSnapshot.owner of a block no listed request holds


@dataclass(slots=True)
class PoolSnapshot:
    """One pool (device or CPU swap), one entry per block. ``filled`` counts the slots claimed (written or
    reserved for this step), ``computed`` the slots whose K/V is written; both 0 for a FREE block, a
    CACHED one keeps the prefix it holds."""

    state: np.ndarray  # uint8
    ref_count: np.ndarray  # uint16
    owner: np.ndarray  # uint16: index into KVSnapshot.requests of the first listed holder, else NO_OWNER
    filled: np.ndarray  # uint16
    computed: np.ndarray  # uint16

    @classmethod
    def empty(cls, num_blocks: int) -> PoolSnapshot:
        zeros = np.zeros(num_blocks, np.uint16)
        return cls(np.zeros(num_blocks, np.uint8), zeros, np.full(num_blocks, NO_OWNER, np.uint16),
                   zeros.copy(), zeros.copy())

    @property
    def num_blocks(self) -> int:
        return len(self.state)

    def set_owners(self, holders: list[list[int]]) -> None:
        """``holders[i]``: the blocks request i holds in this pool; a block's owner is its first holder."""
        blocks = np.fromiter(chain.from_iterable(holders), np.int64)
        holder = np.repeat(np.arange(len(holders), dtype=np.uint16), [len(h) for h in holders])
        np.minimum.at(self.owner, blocks, holder)  # over NO_OWNER, the lowest index holding each block


@dataclass(slots=True)
class PoolsSnapshot:
    """What an allocator says of its pools (``KVAllocator.snapshot``)."""

    device: PoolSnapshot
    cpu: PoolSnapshot
    blocks: list[list[int]]  # per owner asked about: the distinct blocks its sequences hold, in table order


@dataclass(slots=True)
class SnapshotRequest:
    request_id: str
    state: str  # "running", "swapped" or "waiting"
    num_seqs: int  # unfinished sequences (n samples, beam candidates)
    block_ids: list[int]  # in the CPU pool when swapped
    image_block_ids: list[int] = field(default_factory=list)  # of block_ids, those holding image tokens


@dataclass(slots=True)
class KVSnapshot:
    time: float  # wall clock
    block_size: int
    device: PoolSnapshot
    cpu: PoolSnapshot
    # Running, then swapped, then the first waiting ones (running and swapped are the ones holding blocks).
    requests: list[SnapshotRequest]
    stats: EngineStats  # taken at the same moment: the counters agree with the blocks
