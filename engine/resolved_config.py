"""An ``EngineConfig`` resolved against its checkpoint, once, into frozen values with nothing left open
(the model, context length and KV block counts); the user's ``EngineConfig`` is never written to."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

import cuda_ext
from engine.config import EngineConfig
from engine.core.scheduler_config import SchedulerConfig
from engine.demo_model import ensure_demo_model
from engine.distributed.parallel_state import TensorParallel
from engine.kv_cache_dtype import KVCacheDtype
from engine.models.config import ModelConfig, read_model_config, resolve_dtype
from engine.models.layer_kv import kv_token_bytes

logger = logging.getLogger(__name__)

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """What the engine, its model runner and the offline ``LLM`` read after construction."""

    model_config: ModelConfig  # its path: the checkpoint in use (the demo model when none was given)
    tokenizer: str  # the model's folder unless the config names another
    dtype: torch.dtype
    device: torch.device  # this rank's
    scheduler: SchedulerConfig
    show_progress: bool
    kv_cache_dtype: KVCacheDtype
    kv_bytes_per_token: int  # one token's K/V (and scales) in this rank's pool, all layers
    # A draft model's share of a token (speculative_method="draft"): its pool has as many blocks as this one,
    # sized from the same budget.
    draft_kv_bytes_per_token: int = 0
    state_slot_bytes: int = 0  # a hybrid model's recurrent state of one sequence, this rank's share (else 0)
    # Decode-only steps replay CUDA graphs: on CUDA, compiled kernels (the reference ones read lengths on the
    # host) and one rank (a collective inside a graph is not worth its risk), unless enforce_eager or the model
    # syncs with the host inside its forward (MoE: fused_moe sizes its expert groups there).
    decode_graphs: bool = False


def resolve_config(config: EngineConfig, load: Callable[[ModelConfig, torch.device, torch.dtype], M],
                   tp: TensorParallel | None = None) -> tuple[ResolvedConfig, M]:
    """Resolve ``config`` against its checkpoint and load the weights with ``load``: after the
    checks, so a bad config fails before a long load, and before the KV pools are sized, so
    a memory fraction is a share of what the weights left free (``load`` packs them for the
    kernels too, so the packed copies are counted and the released unpacked ones are not). With tensor
    parallelism every rank calls this (``tp``) and they settle on block counts every rank's pool can hold."""
    tp = tp or TensorParallel()
    model_config = read_model_config(config.model or ensure_demo_model())
    device = tp.device(config.device)
    dtype = resolve_dtype(config.dtype, model_config.dtype, device.type)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                         f"({model_config.max_position_embeddings})")
    unsupported = {layer.head_dim for layer in model_config.kv_layers()} - set(cuda_ext.HEAD_SIZES)
    if config.attention_backend == "ext" and unsupported:
        raise ValueError(f"{model_config.path!r} has head size {min(unsupported)}; the compiled paged attention "
                         f"supports {', '.join(map(str, cuda_ext.HEAD_SIZES))} (attention_backend='torch' runs any)")
    draft_bytes = _draft_token_bytes(config, device)  # a bad draft checkpoint fails before the long load
    state = _state_slots(config, model_config, dtype, tp)
    model = load(model_config, device, dtype)
    kv_dtype = KVCacheDtype.resolve(config.kv_cache_dtype, dtype)
    # A rank stores only its KV heads of every block; a layer sharing another's K/V stores none.
    token_bytes = kv_token_bytes(model_config.kv_layers(), kv_dtype.token_bytes, tp.kv_heads)
    num_device_blocks, num_cpu_blocks = tp.agree_min(list(_kv_blocks(config, token_bytes, draft_bytes,
                                                                     max_model_len, device, tp.size,
                                                                     state.device_bytes if state else 0)))
    scheduler = SchedulerConfig.resolved(config, num_device_blocks=num_device_blocks, num_cpu_blocks=num_cpu_blocks,
                                         max_model_len=max_model_len, sliding_window=model_config.kv_window,
                                         **(state.scheduler_fields(num_cpu_blocks) if state else {}))
    decode_graphs = (not config.enforce_eager and device.type == "cuda" and config.attention_backend == "ext"
                     and tp.size == 1 and getattr(model, "graph_capturable", True))
    resolved = ResolvedConfig(model_config=model_config, tokenizer=config.tokenizer or model_config.path,
                              dtype=dtype, device=device, scheduler=scheduler, show_progress=config.show_progress,
                              kv_cache_dtype=kv_dtype, kv_bytes_per_token=token_bytes,
                              draft_kv_bytes_per_token=draft_bytes, decode_graphs=decode_graphs,
                              state_slot_bytes=state.slot_bytes if state else 0)
    return resolved, model


@dataclass(frozen=True, slots=True)
class StateSlots:
    """A hybrid model's recurrent-state slots on the device: one per sequence the batch can hold, and the
    prefix cache's snapshots (engine/core/state_cache.py)."""

    num_slots: int
    num_snapshots: int
    slot_bytes: int  # one slot over every recurrent layer, this rank's heads

    @property
    def device_bytes(self) -> int:
        return (self.num_slots + self.num_snapshots) * self.slot_bytes

    def scheduler_fields(self, num_cpu_blocks: int) -> dict[str, int]:
        """The slot counts; a sequence swapped out takes a CPU slot, where there is a CPU pool to swap to."""
        return {"num_state_slots": self.num_slots, "num_state_snapshots": self.num_snapshots,
                "num_cpu_state_slots": self.num_slots if num_cpu_blocks else 0}


def _state_slots(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                 tp: TensorParallel) -> StateSlots | None:
    spec = model_config.linear_state
    if spec is None:
        return None
    if config.speculative_method is not None:
        raise ValueError(f"{model_config.path!r} is a hybrid recurrent-state model: speculative decoding is not "
                         "supported for it (a rejected draft would need its recurrent state rolled back)")
    snapshots = config.num_state_snapshots if config.num_state_snapshots is not None else config.max_num_seqs
    state = StateSlots(config.max_num_seqs, snapshots if config.enable_prefix_caching else 0,
                       spec.slot_bytes(dtype.itemsize, tp.size))
    logger.info("recurrent state: %d sequence slots and %d prefix-cache snapshots of %.2f MiB each (%d layers)",
                state.num_slots, state.num_snapshots, state.slot_bytes / 2**20, len(spec.layers))
    return state


def _draft_token_bytes(config: EngineConfig, device: torch.device) -> int:
    """One token's K/V in a draft model's pool, 0 without one. The draft follows every running sequence with a
    block table of its own, so one block of budget pays for both models' K/V of its tokens. (Under tensor
    parallelism only rank 0 runs the draft; every rank counts it, so the ranks still agree.)"""
    if config.speculative_method != "draft":
        return 0
    draft = read_model_config(config.speculative_model)
    kv_dtype = KVCacheDtype.resolve(config.kv_cache_dtype, resolve_dtype(config.dtype, draft.dtype, device.type))
    return kv_token_bytes(draft.kv_layers(), kv_dtype.token_bytes)


def _kv_blocks(config: EngineConfig, token_bytes: int, draft_bytes: int, max_model_len: int,
               device: torch.device, num_ranks: int, state_bytes: int = 0) -> tuple[int, int]:
    """Device and CPU block counts; those not given come from the byte budgets (a device block's share of
    the budget holds a draft model's K/V too; a hybrid model's recurrent state slots, ``state_bytes``, come out
    of it first). The device pool is capped at what ``max_num_seqs`` full-length sequences could ever use:
    more blocks would only idle."""
    block_bytes = token_bytes * config.block_size
    device_block_bytes = (token_bytes + draft_bytes) * config.block_size
    num_device_blocks = config.num_device_blocks
    if num_device_blocks is None:
        # Tensor-parallel ranks on CPU share one memory; on GPUs each has its own.
        share = num_ranks if device.type == "cpu" else 1
        budget = config.kv_cache_memory_bytes or int(_available_memory(device) * config.kv_cache_memory_fraction
                                                     / share)
        budget -= state_bytes
        num_device_blocks = min(budget // device_block_bytes,
                                config.max_num_seqs * -(-max_model_len // config.block_size))
        if num_device_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {device_block_bytes} bytes")
    num_cpu_blocks = config.num_cpu_blocks
    if num_cpu_blocks is None:
        num_cpu_blocks = min(config.swap_space_bytes // block_bytes, num_device_blocks)
    logger.info("KV cache: %d device blocks and %d CPU swap blocks of %d tokens (%.1f MiB per block, %d bytes per "
                "token, %s%s)", num_device_blocks, num_cpu_blocks, config.block_size, device_block_bytes / 2**20,
                token_bytes, config.kv_cache_dtype, f", {draft_bytes} for the draft model" if draft_bytes else "")
    return num_device_blocks, num_cpu_blocks


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024
