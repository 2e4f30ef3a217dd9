"""Recurrent-state slots beside the block pool, for hybrid models (Qwen3-Next, Qwen3.5: Gated DeltaNet layers
between full-attention ones). A linear-attention layer keeps a fixed-size state per sequence (its conv window
and recurrent matrix) instead of K/V per token, so a sequence holds one state slot however long it is.

The slots are ids into the model runner's state pools (one device and one CPU pool per layer kind). A sequence
takes a device slot at admission and gives it back when it finishes, is aborted or preempted by recompute (a
recompute rebuilds the state from the tokens); a fork copies the parent's slot into a new one (``n > 1``, beam
search), a swap moves the state with its group's blocks. Every content move is queued here, in the order it was
decided, and the runner replays the queue before the step's forward pass (``take_moves``): a slot freed and
reused within one step is read before it is overwritten.

Prefix caching: a block hit must restore the state as it was after the hit's last token. Snapshots keep that
state at block boundaries, keyed by the chain hash of the block that ends there, in slots of their own (bounded,
LRU): a prefill chunk saves one at its last full-block boundary inside the prompt, written by the ops during the
forward pass (``StateStep.save_slot``) and bound to its hash once the block is registered (``commit_save``)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

MoveKind = Literal["copy", "swap_out", "swap_in"]


@dataclass(frozen=True, slots=True)
class StateMove:
    """One slot's state copied: device to device (``copy``), device to CPU (``swap_out``) or back (``swap_in``)."""

    kind: MoveKind
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class StateStep:
    """A scheduled sequence's state this step: its device slot, and where its snapshot goes (-1: none) after
    ``save_at`` of the step's tokens."""

    slot: int
    save_slot: int = -1
    save_at: int = 0


@dataclass(frozen=True, slots=True)
class StateCacheStats:
    num_slots: int
    num_used_slots: int
    num_cpu_slots: int
    num_cpu_used_slots: int
    num_snapshots: int  # snapshot slots
    num_used_snapshots: int
    snapshot_hits: int  # admissions that restored a snapshot, ever


class StateCache:
    """Device slots ``[0, num_slots)`` serve sequences, ``[num_slots, num_slots + num_snapshots)`` snapshots."""

    def __init__(self, num_slots: int, num_snapshots: int, num_cpu_slots: int, block_size: int) -> None:
        self.num_slots, self.num_snapshots, self.num_cpu_slots = num_slots, num_snapshots, num_cpu_slots
        self.block_size = block_size
        self._free = list(range(num_slots - 1, -1, -1))
        self._free_cpu = list(range(num_cpu_slots - 1, -1, -1))
        self._free_snapshots = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self.slot_of: dict[int, int] = {}  # seq id -> device slot
        self.cpu_slot_of: dict[int, int] = {}  # seq id -> CPU slot, while swapped out
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recently used first
        self._saving: dict[int, tuple[int, int]] = {}  # seq id -> (snapshot slot, boundary) its step writes
        self._moves: list[StateMove] = []
        self.snapshot_hits = 0

    # -- sequences -------------------------------------------------------------
    def allocate(self, seq_id: int, restore: bytes | None = None) -> None:
        """A device slot for a new sequence: fresh (its first step starts from zeros), or holding the snapshot
        at ``restore`` (a prefix-cache hit ending at that block)."""
        slot = self._take(seq_id)
        if restore is not None:
            self._snapshots.move_to_end(restore)
            self._moves.append(StateMove("copy", self._snapshots[restore], slot))
            self.snapshot_hits += 1

    def fork(self, parent_id: int, child_id: int) -> None:
        self._moves.append(StateMove("copy", self.slot_of[parent_id], self._take(child_id)))

    def free(self, seq_id: int) -> None:
        """Gives back the sequence's slot (device or CPU) and drops a snapshot it was writing."""
        if (slot := self.slot_of.pop(seq_id, None)) is not None:
            self._free.append(slot)
        if (slot := self.cpu_slot_of.pop(seq_id, None)) is not None:
            self._free_cpu.append(slot)
        if (saving := self._saving.pop(seq_id, None)) is not None:
            self._free_snapshots.append(saving[0])

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return len(seq_ids) <= len(self._free_cpu)

    def swap_out(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            slot, cpu = self.slot_of.pop(seq_id), self._free_cpu.pop()
            self.cpu_slot_of[seq_id] = cpu
            self._moves.append(StateMove("swap_out", slot, cpu))
            self._free.append(slot)

    def swap_in(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            cpu = self.cpu_slot_of.pop(seq_id)
            self._moves.append(StateMove("swap_in", cpu, self._take(seq_id)))
            self._free_cpu.append(cpu)

    def _take(self, seq_id: int) -> int:
        if seq_id in self.slot_of:
            raise ValueError(f"sequence {seq_id} already has a state slot")
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are taken (the scheduler admits at most "
                               "max_num_seqs sequences)")
        slot = self.slot_of[seq_id] = self._free.pop()
        return slot

    # -- snapshots -------------------------------------------------------------
    def has_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self._snapshots

    def step(self, seq_id: int, start: int, num_new_tokens: int, num_tokens: int) -> StateStep:
        """The sequence's slot this step, and a snapshot to save where the step is a prefill chunk that passes a
        block boundary below the prompt's last token (what a later identical or longer prompt hits): into a free
        or the least recently used snapshot slot (none without snapshot slots: prefix caching off)."""
        slot = self.slot_of[seq_id]
        boundary = min(start + num_new_tokens, num_tokens - 1) // self.block_size * self.block_size
        if boundary <= start or not (self._free_snapshots or self._snapshots):  # every snapshot slot in flight
            return StateStep(slot)
        if self._free_snapshots:
            save = self._free_snapshots.pop()
        else:
            _, save = self._snapshots.popitem(last=False)
        self._saving[seq_id] = (save, boundary)
        return StateStep(slot, save, boundary - start)

    def saving_boundary(self, seq_id: int) -> int | None:
        saving = self._saving.get(seq_id)
        return None if saving is None else saving[1]

    def commit_save(self, seq_id: int, block_hash: bytes) -> None:
        """The step that wrote the sequence's snapshot is done; it now stands for the block ``block_hash``."""
        save, _ = self._saving.pop(seq_id)
        if (old := self._snapshots.pop(block_hash, None)) is not None:
            self._free_snapshots.append(old)
        self._snapshots[block_hash] = save

    def take_moves(self) -> list[StateMove]:
        """The moves decided since the last call, in order: the runner replays them before the forward pass."""
        moves, self._moves = self._moves, []
        return moves

    def stats(self) -> StateCacheStats:
        return StateCacheStats(num_slots=self.num_slots, num_used_slots=len(self.slot_of),
                               num_cpu_slots=self.num_cpu_slots, num_cpu_used_slots=len(self.cpu_slot_of),
                               num_snapshots=self.num_snapshots,
                               num_used_snapshots=len(self._snapshots) + len(self._saving),
                               snapshot_hits=self.snapshot_hits)
