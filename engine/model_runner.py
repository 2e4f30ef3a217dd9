"""Turns a SchedulerOutput into one forward pass over the paged KV pool."""
from __future__ import annotations

import logging

import torch
from torch import nn

from cuda_ext import KernelOps
from engine.config import EngineConfig
from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.layers.attention import AttentionMetadata
from engine.models.config import ModelConfig

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the KV pools (device and CPU swap) and runs the model on a flattened batch."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, config: EngineConfig, ops: KernelOps,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.ops, self.device = model, ops, device
        self.block_size = config.block_size
        shape = (model_config.num_layers, 2, model_config.num_kv_heads, config.block_size, model_config.head_dim)
        self.kv_cache = _new_pool(config.num_device_blocks, shape, dtype, device)
        # Swap-ins only read blocks a swap-out wrote, so the CPU pool needs no zeroing.
        self.cpu_cache = torch.empty((config.num_cpu_blocks, *shape), dtype=dtype, device="cpu",
                                     pin_memory=device.type == "cuda" and config.num_cpu_blocks > 0)
        for i, attn in enumerate(model.attention_layers()):
            attn.bind(ops, self.kv_cache[:, i, 0], self.kv_cache[:, i, 1])

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Moves blocks, runs the model; returns fp32 logits for the ``do_sample`` seqs, in schedule order."""
        self._move_blocks(out)
        if not out.scheduled:
            return None
        input_ids, positions, meta, sample_rows = self._prepare(out.scheduled)
        hidden = self.model(input_ids, positions, meta)
        if sample_rows.numel() == 0:
            return None
        return self.model.compute_logits(hidden[sample_rows]).float()

    def _move_blocks(self, out: SchedulerOutput) -> None:
        # Order matters: swapped-out blocks may be reused by swap-ins and copies of this same step.
        if out.blocks_to_swap_out:
            self.ops.swap_blocks(self.kv_cache, self.cpu_cache, _mapping(out.blocks_to_swap_out))
        if out.blocks_to_swap_in:
            self.ops.swap_blocks(self.cpu_cache, self.kv_cache, _mapping(out.blocks_to_swap_in))
        if out.blocks_to_copy:
            self.ops.copy_blocks(self.kv_cache, _mapping(out.blocks_to_copy).to(self.device))

    def _prepare(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """One pass over the seqs, one tensor per field; slots are computed vectorised, not per token."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        for s in scheduled:
            end = s.start + s.num_new_tokens
            input_ids += s.seq.token_ids[s.start:end]
            positions += range(s.start, end)
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            if s.do_sample:
                sample_rows.append(len(input_ids) - 1)
        width = max(len(s.block_table) for s in scheduled)
        block_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in scheduled],
                                    dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.int64)
        qlens = torch.tensor(query_lens, dtype=torch.int32)
        owner = torch.repeat_interleave(torch.arange(len(scheduled)), qlens)
        slots = block_tables[owner, pos // self.block_size].long() * self.block_size + pos % self.block_size
        qsl = torch.zeros(len(scheduled) + 1, dtype=torch.int32)
        torch.cumsum(qlens, 0, out=qsl[1:])
        meta = AttentionMetadata(
            slot_mapping=self._dev(slots), block_tables=self._dev(block_tables),
            seq_lens=self._dev(torch.tensor(seq_lens, dtype=torch.int32)), query_start_loc=self._dev(qsl),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens))
        ids = self._dev(torch.tensor(input_ids, dtype=torch.int64))
        return ids, self._dev(pos), meta, self._dev(torch.tensor(sample_rows, dtype=torch.int64))

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.pin_memory().to(self.device, non_blocking=True)


def _new_pool(num_blocks: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """On CUDA zeroed, so masked-out lanes a kernel reads never hold NaNs. On CPU the
    kernels read only written slots, and an untouched ``empty`` pool costs no RAM
    until blocks are used (a pool sized for the worst case stays cheap)."""
    if device.type == "cuda":
        return torch.zeros((num_blocks, *shape), dtype=dtype, device=device)
    return torch.empty((num_blocks, *shape), dtype=dtype)


def _mapping(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)


def resolve_kv_blocks(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Fill ``config.num_device_blocks`` / ``num_cpu_blocks`` from byte budgets when not given.

    The device pool is capped at what ``max_num_seqs`` full-length sequences
    could ever use: more blocks would only idle (and on CPU, be zeroed for nothing).
    """
    block_bytes = model_config.kv_elements_per_token * config.block_size * dtype.itemsize
    max_useful = config.max_num_seqs * -(-config.max_model_len // config.block_size)
    if config.num_device_blocks is None:
        budget = config.kv_cache_memory_bytes or int(_available_memory(device) * config.kv_cache_memory_fraction)
        config.num_device_blocks = min(budget // block_bytes, max_useful)
        if config.num_device_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {block_bytes} bytes")
    if config.num_cpu_blocks is None:
        config.num_cpu_blocks = min(config.swap_space_bytes // block_bytes, config.num_device_blocks)
    logger.info("KV cache: %d device blocks and %d CPU swap blocks of %d tokens (%.1f MiB per block)",
                config.num_device_blocks, config.num_cpu_blocks, config.block_size, block_bytes / 2**20)


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024
