"""What the scheduler and its KV manager read: an ``EngineConfig``'s scheduling fields, resolved."""
from __future__ import annotations

from dataclasses import dataclass, fields

from engine.config import EngineConfig, KVAllocatorName, PreemptionMode


# Settled by the checkpoint (its defaults without one), never read from an EngineConfig.
_MODEL_DERIVED = frozenset({"sliding_window", "num_state_slots", "num_state_snapshots", "num_cpu_state_slots"})


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int
    num_device_blocks: int
    num_cpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None  # None only without a model, where nothing caps a sequence
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    preemption_mode: PreemptionMode
    kv_allocator: KVAllocatorName
    # The model's: no layer sees keys further back (0: some layer sees all), so blocks behind it are freed.
    sliding_window: int
    num_speculative_tokens: int = 0  # the most proposed tokens a decode verifies (0: no speculation)
    # A hybrid model's recurrent state slots (engine/core/state_cache.py): device slots for sequences (0: not
    # hybrid), for prefix-cache snapshots, and CPU slots for swapped sequences.
    num_state_slots: int = 0
    num_state_snapshots: int = 0
    num_cpu_state_slots: int = 0

    @classmethod
    def resolved(cls, config: EngineConfig, **values: int) -> SchedulerConfig:
        """``config``'s scheduling fields, with the resolved ``values`` in place of its own (and of the
        model's, which ``config`` lacks)."""
        spec = config.speculative_config
        own = {f.name: getattr(config, f.name) for f in fields(cls) if f.name not in values
               and f.name not in _MODEL_DERIVED}
        own["num_speculative_tokens"] = spec.num_speculative_tokens if spec is not None else 0
        return cls(**(own | values))

    @classmethod
    def without_model(cls, config: EngineConfig) -> SchedulerConfig:
        """For the scheduler alone (its tests, the paper's simulation): no checkpoint
        sizes the pools, so ``config`` must give the device block count."""
        if config.num_device_blocks is None:
            raise ValueError("without a model, num_device_blocks must be given")
        return cls.resolved(config, num_cpu_blocks=config.num_cpu_blocks or 0, sliding_window=0)
