"""Builders and independent checks shared by the core tests."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.core.scheduler_output import SchedulerOutput
from engine.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup


def make_seq(token_ids: list[int], num_prompt_tokens: int | None = None) -> Sequence:
    tokens = list(token_ids)
    return Sequence(tokens, len(tokens) if num_prompt_tokens is None else num_prompt_tokens)


def make_group(request_id: str, prompt: list[int], arrival: float = 0.0, n: int = 1,
               salt: bytes | None = None, max_tokens: int | None = 16, priority: int = 0) -> SequenceGroup:
    params = SamplingParams(n=n, max_tokens=max_tokens)
    return SequenceGroup(request_id, [make_seq(prompt)], params, arrival, cache_salt=salt, priority=priority)


def make_scheduler(**overrides) -> Scheduler:
    fields = dict(num_device_blocks=64, block_size=8, max_num_seqs=8, max_num_batched_tokens=64)
    fields.update(overrides)
    return Scheduler(SchedulerConfig.without_model(EngineConfig(**fields)))


def _default_token(group: SequenceGroup, seq: Sequence) -> int:
    return (seq.seq_id * 7 + seq.num_tokens) % 50  # differs between sequences


def sample(out: SchedulerOutput, token: Callable[[SequenceGroup, Sequence], int] = _default_token) -> SamplerOutput:
    """What a sampler would return for ``out``: a deterministic token per sample."""
    tokens = [token(s.group, seq) for _, s, seq in out.samples()]
    return SamplerOutput(tokens, [None] * len(tokens))


def run_step(sched: Scheduler, memory: KVMemory | None = None) -> SchedulerOutput:
    """One engine step: schedule, (simulated) forward pass, sample, update_from_output."""
    out = sched.schedule()
    if memory is not None:
        memory.execute(out, sched.config.block_size)
    sched.update_from_output(out, sample(out))
    return out


class KVMemory:
    """A model of the device and CPU KV pools: what token each slot holds.

    Executes a SchedulerOutput in the runner's order (swap-out, swap-in,
    copies, forward writes) so tests can check that every sequence's table
    really points at its own tokens."""

    def __init__(self) -> None:
        self.device: dict[int, dict[int, int]] = {}
        self.cpu: dict[int, dict[int, int]] = {}

    def execute(self, out: SchedulerOutput, block_size: int) -> None:
        for dev, cpu in out.blocks_to_swap_out:
            self.cpu[cpu] = dict(self.device.get(dev, {}))
        for cpu, dev in out.blocks_to_swap_in:
            self.device[dev] = dict(self.cpu.get(cpu, {}))
        for src, dst in out.blocks_to_copy:
            self.device[dst] = dict(self.device.get(src, {}))
        for s in out.scheduled:
            for pos in range(s.start, s.start + s.num_new_tokens):
                block = s.block_table[pos // block_size]
                self.device.setdefault(block, {})[pos % block_size] = s.seq.token_ids[pos]

    def tokens_of(self, block_ids: list[int], num_tokens: int, block_size: int, on_cpu: bool) -> list[int | None]:
        pool = self.cpu if on_cpu else self.device
        return [pool.get(block_ids[i // block_size], {}).get(i % block_size) for i in range(num_tokens)]


def check_kv_invariants(kv: KVCacheManager) -> None:
    """Block accounting, checked against the tables (not the pool's counters)."""
    for pool, on_cpu in ((kv.device_pool, False), (kv.cpu_pool, True)):
        refs = Counter(b.block_id for t in kv.tables.values() if t.on_cpu == on_cpu for b in t.held())
        free = set(pool.free_block_ids())
        assert len(free) == pool.num_free_blocks
        assert not free & set(refs), "a block is both free and mapped"
        assert len(free) + len(refs) == pool.num_blocks, "free + used != total"
        for block in pool.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), f"ref count of block {block.block_id}"
    bs = kv.block_size
    for table in kv.tables.values():
        assert table.blocks[:table.num_released] == [None] * table.num_released and None not in table.held()
        assert table.block_ids == [0] * table.num_released + [b.block_id for b in table.held()]
        assert len(table.blocks) == -(-table.num_slots // bs)
    stats = kv.stats()
    assert stats.num_external_frag_slots == 0  # any free block serves any request
    assert (stats.num_tokens_stored + stats.num_reserved_slots + stats.num_internal_frag_slots
            + stats.num_free_slots == stats.num_blocks * bs)
    stored = {b.block_id: b.num_computed for t in kv.tables.values() if not t.on_cpu for b in t.held()}
    assert stats.num_tokens_stored == sum(stored.values())


def arena_decomposition(num_blocks: int) -> list[tuple[int, int]]:
    """A buddy arena's initial free runs, (start, size): its size in binary, largest first."""
    runs, start = [], 0
    for k in range(num_blocks.bit_length() - 1, -1, -1):
        if num_blocks >> k & 1:
            runs.append((start, 1 << k))
            start += 1 << k
    return runs
