"""Turns a SchedulerOutput into one forward pass over the paged KV pool, in two halves: ``plan`` (host tensors:
the block moves and the flattened batch) and ``run`` (on this rank's device and KV pool). With tensor
parallelism rank 0 plans and every rank runs the same plan (engine/distributed/executor.py)."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import repeat

import torch
from torch import nn

from cuda_ext import KernelOps
from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache_dtype import KV_SCALE_DTYPE
from engine.core.state_cache import StateMove
from engine.layers.attention import AttentionMetadata, StateMetadata
from engine.models.layer_kv import KVPoolGroup, pool_groups
from engine.multimodal.step import ImageStep, StepImages
from engine.resolved_config import ResolvedConfig
from engine.step_inputs import StepBuffers, StepLayout, StepTensors, TokenFill


@dataclass(slots=True)
class Batch:
    """The flattened step (``ModelRunner._prepare``)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the hidden states that get logits
    need_logits: bool = True  # False: every sampled row takes the argmax only (SamplingParams.argmax_only)
    # Rows whose logits score the next prompt token (ScheduledSeq.prompt_logprob_positions), usually none. Their
    # targets (those next tokens) and the largest top-k asked are rank 0's only: the others just join the LM head.
    prompt_rows: torch.Tensor = field(default_factory=lambda: _NO_ROWS)
    prompt_targets: torch.Tensor = field(default_factory=lambda: _NO_ROWS)
    prompt_k: int = 0
    # Rows pooled into embeddings (ScheduledSeq.pool_positions) and, per row, its segment: one per pooling seq of
    # the step, in schedule order. Rank 0's only (the hidden states are whole on every rank).
    pool_rows: torch.Tensor = field(default_factory=lambda: _NO_ROWS)
    pool_segments: torch.Tensor = field(default_factory=lambda: _NO_ROWS)
    images: StepImages | None = None  # the step's image rows and M-RoPE positions (engine/multimodal/step.py)


@dataclass(slots=True)
class PromptLogprobs:
    """Per ``Batch.prompt_rows`` row, on the host: its target token's fp32 logprob and the top ``prompt_k``."""

    token: torch.Tensor  # [rows]
    top_ids: torch.Tensor  # [rows, k]
    top_logprobs: torch.Tensor  # [rows, k]


@dataclass(slots=True)
class Logits:
    """The sampled rows' fp32 logits, and their argmax when the LM head computed it on the way (else None).
    No values when the step needed only the argmax and the LM head gave it alone."""

    values: torch.Tensor | None
    argmax: torch.Tensor | None = None
    prompt: PromptLogprobs | None = None  # when a seq of the step asked for prompt logprobs
    pooled: torch.Tensor | None = None  # [segments, hidden] fp32 on the host: each pooling seq's rows summed

    def __len__(self) -> int:
        return (self.argmax if self.values is None else self.values).shape[0]

    def select(self, rows: list[int]) -> Logits:
        values, argmax = self.values, self.argmax
        return Logits(None if values is None else values[rows], None if argmax is None else argmax[rows])


@dataclass(slots=True)
class StepPlan:
    """Everything a rank needs to run one step, on the host: the block moves ([n, 2] int64 (src, dst) pairs)
    and the batch (None when the step only moves blocks)."""

    swap_out: torch.Tensor
    swap_in: torch.Tensor
    copies: torch.Tensor
    batch: Batch | None
    state_moves: list[StateMove] = field(default_factory=list)  # a hybrid model's, in order


class ModelRunner:
    """Owns the KV pools (device and CPU swap) and runs the model on a flattened batch."""

    def __init__(self, model: nn.Module, config: ResolvedConfig, ops: KernelOps) -> None:
        self.model, self.ops, self.device = model, ops, config.device
        m, sched = config.model_config, config.scheduler
        self.block_size = sched.block_size
        attention = model.attention_layers()
        # (device, CPU swap) pool pairs, all indexed by one block id: every block move applies to each.
        self.pools: list[tuple[torch.Tensor, torch.Tensor]] = []
        views: dict[int, tuple[torch.Tensor, ...]] = {}
        for group in pool_groups(m.kv_layers()):  # one pool per K/V shape; this rank's KV heads only
            views |= self._new_pools(group, attention[group.layers[0]].num_kv_heads, config)
        for attn, layer in zip(attention, m.kv_layers()):  # a layer sharing K/V reads its source's blocks
            attn.bind(ops, *views[layer.source])
        # A hybrid model's recurrent layers: (device, CPU swap) pool pairs indexed by state slot
        # (engine/core/state_cache.py), two per layer (conv windows, recurrent matrices).
        self.state_pools: list[tuple[torch.Tensor, torch.Tensor]] = []
        if m.linear_state is not None:
            self._bind_state_pools(model.state_layers(), config)
        self.inputs = StepBuffers(self.device)  # the eager steps' inputs (CUDA; a CPU step reads its own tensors)
        self.graphs: DecodeGraphs | None = None
        self.images: ImageStep | None = None  # a vision-language model's, set by the engine (engine/multimodal)
        self._max_num_seqs, self._max_model_len = sched.max_num_seqs, sched.max_model_len
        if config.decode_graphs:
            self.enable_decode_graphs()

    def _new_pools(self, group: KVPoolGroup, num_kv_heads: int, config: ResolvedConfig
                   ) -> dict[int, tuple[torch.Tensor, ...]]:
        """The group's pools: its codes and, for a quantized cache, their scales (one per slot and KV head of K
        and of V, indexed by block like the codes, so a block's scales move with it). Returns each layer's
        views: K, V (and K, V scales); one tensor as both where the group stores it once (MLA's latent)."""
        sched, kv = config.scheduler, config.kv_cache_dtype
        shape = (len(group.layers), group.parts, num_kv_heads, sched.block_size, group.head_dim)
        kinds = [(shape, kv.dtype)] + ([(shape[:-1], KV_SCALE_DTYPE)] if kv.quantized else [])
        device_pools = []
        for pool_shape, dtype in kinds:
            device_pools.append(_new_pool(sched.num_device_blocks, pool_shape, dtype, self.device))
            self.pools.append((device_pools[-1], _cpu_pool(sched.num_cpu_blocks, pool_shape, dtype, self.device)))
        return {layer: tuple(pool[:, j, part] for pool in device_pools for part in (0, group.parts - 1))
                for j, layer in enumerate(group.layers)}

    def _bind_state_pools(self, layers: list, config: ResolvedConfig) -> None:
        """Zeroed pools: a slot read before any write (a fresh sequence) must not hold NaNs, even masked."""
        sched = config.scheduler
        num_slots = sched.num_state_slots + sched.num_state_snapshots
        for layer in layers:
            pools = []
            for shape, dtype in zip(layer.state_shapes(), (config.dtype, torch.float32)):
                device_pool = torch.zeros((num_slots, *shape), dtype=dtype, device=self.device)
                pools.append(device_pool)
                self.state_pools.append((device_pool, _cpu_pool(sched.num_cpu_state_slots, shape, dtype,
                                                                self.device)))
            layer.bind(self.ops, *pools)

    def enable_decode_graphs(self) -> None:
        """Decode-only steps from now on padded to ``DecodeGraphs``' buckets (captured as CUDA graphs on CUDA)."""
        self.graphs = DecodeGraphs(self.model, self._max_num_seqs, -(-self._max_model_len // self.block_size),
                                   self._max_model_len, self.device)

    def execute(self, out: SchedulerOutput) -> Logits | None:
        """Moves blocks, runs the model; returns fp32 logits for the ``do_sample`` seqs, in schedule order."""
        return self.run(self.plan(out))

    def plan(self, out: SchedulerOutput) -> StepPlan:
        batch = self._prepare(out.scheduled) if out.scheduled else None
        if batch is not None and self.images is not None:  # images: M-RoPE positions, placeholder rows
            batch.images = self.images.plan(out.scheduled, batch.positions)
        return StepPlan(swap_out=_mapping(out.blocks_to_swap_out), swap_in=_mapping(out.blocks_to_swap_in),
                        copies=_mapping(out.blocks_to_copy), batch=batch, state_moves=out.state_moves)

    @torch.inference_mode()
    def run(self, plan: StepPlan, fill: TokenFill | None = None) -> Logits | None:
        """The logits (None without sampled rows, and on tensor-parallel ranks other than 0)."""
        self._move_blocks(plan)
        b = plan.batch
        if b is None:
            return None
        hidden, sample_rows = self._forward(b, fill)
        prompt = self._prompt_logprobs(hidden, b) if b.prompt_rows.numel() else None
        pooled = self._pool(hidden, b) if b.pool_rows.numel() else None
        if b.sample_rows.numel() == 0:
            return None if prompt is None and pooled is None else Logits(None, None, prompt, pooled)
        # index_select, not hidden[rows]: advanced indexing runs an OpenMP region (~0.2 ms, more under load).
        logits, argmax = self.model.compute_logits(hidden.index_select(0, sample_rows), b.need_logits)
        if logits is None:
            if argmax is None and prompt is None and pooled is None:
                return None
            return Logits(None, argmax, prompt, pooled)
        if not b.need_logits and argmax is None:  # the argmax on the logits as they are: no fp32 copy of them
            return Logits(None, self.ops.row_argmax(logits), prompt, pooled)
        return Logits(logits.float(), argmax, prompt, pooled)

    def _forward(self, b: Batch, fill: TokenFill | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states (a decode step padded to its bucket: extra rows) and the rows to sample, on the
        device; the inputs reach a CUDA device in one copy, then take ``fill``'s tokens."""
        step, m = StepTensors(b.input_ids, b.positions, b.meta, b.sample_rows), b.meta
        width = m.block_tables.shape[1]
        if (self.graphs is not None and not b.prompt_rows.numel() and not b.pool_rows.numel() and b.images is None
                and self.graphs.accepts(len(m.seq_lens), m.max_query_len, width)):
            return self.graphs.forward(step, fill)
        if self.device.type != "cpu":
            step = self.inputs.load(StepLayout(len(b.input_ids), len(m.seq_lens), width, len(b.sample_rows)), step)
        if fill is not None:
            fill.apply(step.input_ids)
        if m.state is not None:
            step.meta.state = m.state if self.device.type == "cpu" else m.state.to(self.device)
        if b.images is not None:  # images: their embeddings at the placeholder rows, M-RoPE
            return self.model(step.input_ids, step.positions, step.meta,
                              images=self.images.inputs(b.images, self.device)), step.sample_rows
        return self.model(step.input_ids, step.positions, step.meta), step.sample_rows

    def _prompt_logprobs(self, hidden: torch.Tensor, b: Batch) -> PromptLogprobs | None:
        """The prompt rows scored a slice at a time, so no more than one slice's [rows, vocab] logits exist at
        once; only each row's target logprob and top k are kept. None on tensor-parallel ranks other than 0."""
        parts = []
        for i in range(0, len(b.prompt_rows), _PROMPT_ROWS_PER_PASS):
            rows = self._dev(b.prompt_rows[i:i + _PROMPT_ROWS_PER_PASS])
            logits, _ = self.model.compute_logits(hidden.index_select(0, rows))
            if logits is not None:  # rank 0
                targets = self._dev(b.prompt_targets[i:i + _PROMPT_ROWS_PER_PASS])
                logprobs = logits.float().log_softmax(dim=-1)
                top_logprobs, top_ids = logprobs.topk(b.prompt_k, dim=-1)
                parts.append((logprobs.gather(1, targets.unsqueeze(1)).squeeze(1), top_ids, top_logprobs))
        if not parts:
            return None
        return PromptLogprobs(*(torch.cat(column).cpu() for column in zip(*parts)))

    def _pool(self, hidden: torch.Tensor, b: Batch) -> torch.Tensor:
        """Each pooling seq's rows summed in fp32 (one row for last-token and CLS pooling): a mean's chunks add
        up across steps (engine/core/pooling.py)."""
        segments = self._dev(b.pool_segments)
        rows = hidden.index_select(0, self._dev(b.pool_rows)).float()
        num_segments = int(b.pool_segments[-1]) + 1
        return rows.new_zeros(num_segments, rows.shape[1]).index_add_(0, segments, rows).cpu()

    def _move_blocks(self, plan: StepPlan) -> None:
        # Order matters: swapped-out blocks may be reused by swap-ins and copies of this same step.
        for device_pool, cpu_pool in self.pools:
            if plan.swap_out.numel():
                self.ops.swap_blocks(device_pool, cpu_pool, plan.swap_out)
            if plan.swap_in.numel():
                self.ops.swap_blocks(cpu_pool, device_pool, plan.swap_in)
            if plan.copies.numel():
                self.ops.copy_blocks(device_pool, plan.copies.to(self.device))
        for move in plan.state_moves:  # one by one, in order: a slot may be read, then reused, in one step
            for device_pool, cpu_pool in self.state_pools:
                src, dst = _STATE_MOVES[move.kind](device_pool, cpu_pool)
                dst[move.dst].copy_(src[move.src], non_blocking=True)

    def _prepare(self, scheduled: list[ScheduledSeq]) -> Batch:
        """One pass over the seqs into flat typed arrays, each wrapped as a tensor without a per-element
        conversion (``torch.tensor`` of a list costs ~0.3 us an element). Slots go a block-run at a time
        (``extend(range)``), so there is no per-token Python even in a long prefill."""
        input_ids, positions, slots, sample_rows = array("q"), array("q"), array("q"), array("q")
        prompt_rows, prompt_targets, prompt_k = array("q"), array("q"), 0
        pool_rows, pool_segments = array("q"), array("q")
        argmax_only = True
        query_start_loc, seq_lens, block_tables = array("i", [0]), array("i"), array("i")
        states = array("q")  # a hybrid model's per-seq slot, has-initial, save slot, save offset
        width, bs = max(len(s.block_table) for s in scheduled), self.block_size
        for s in scheduled:
            start, table = s.start, s.block_table
            end = start + s.num_new_tokens
            if end - start == 1:  # a decode step: one token, one slot (no slices or ranges to build)
                input_ids.append(s.seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                drafts = s.draft_token_ids  # after the sequence's own tokens (speculative decoding)
                input_ids.fromlist(s.seq.token_ids[start:end - len(drafts)])
                input_ids.extend(drafts)
                positions.extend(range(start, end))
                _append_slots(slots, table, start, end, bs)
            if start < s.seq.num_prompt_tokens - 1 and (span := s.prompt_logprob_positions()):  # decodes: never
                first = len(input_ids) - (end - start)  # this chunk's first row
                prompt_rows.extend(range(first, first + len(span)))
                prompt_targets.fromlist(s.seq.token_ids[span.start + 1:span.stop + 1])
                prompt_k = max(prompt_k, s.group.params.prompt_logprobs)
            if s.group.pooling is not None and (span := s.pool_positions()):
                first = len(input_ids) - (end - start) - start  # the row of position 0
                pool_rows.extend(range(first + span.start, first + span.stop))
                pool_segments.extend(repeat(pool_segments[-1] + 1 if pool_segments else 0, len(span)))
            if s.state is not None:
                states.extend((s.state.slot, start > 0, s.state.save_slot, s.state.save_at))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            block_tables.fromlist(table)
            if len(table) < width:
                block_tables.extend(repeat(0, width - len(table)))  # padding, never read
            if s.do_sample:
                if s.draft_token_ids:  # a verification: logits at every position, its drafts' and the bonus one
                    sample_rows.extend(range(len(input_ids) - 1 - len(s.draft_token_ids), len(input_ids)))
                else:
                    sample_rows.append(len(input_ids) - 1)
                argmax_only = argmax_only and s.group.params.argmax_only
        meta = AttentionMetadata(
            slot_mapping=_host_tensor(slots, torch.int64),
            block_tables=_host_tensor(block_tables, torch.int32).view(len(scheduled), width),
            seq_lens=_host_tensor(seq_lens, torch.int32), query_start_loc=_host_tensor(query_start_loc, torch.int32),
            max_query_len=max(s.num_new_tokens for s in scheduled), max_seq_len=max(seq_lens),
            state=_state_metadata(states))
        return Batch(input_ids=_host_tensor(input_ids, torch.int64), positions=_host_tensor(positions, torch.int64),
                     meta=meta, sample_rows=_host_tensor(sample_rows, torch.int64), need_logits=not argmax_only,
                     prompt_rows=_host_tensor(prompt_rows, torch.int64),
                     prompt_targets=_host_tensor(prompt_targets, torch.int64), prompt_k=prompt_k,
                     pool_rows=_host_tensor(pool_rows, torch.int64),
                     pool_segments=_host_tensor(pool_segments, torch.int64))

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.pin_memory().to(self.device, non_blocking=True)


def _state_metadata(states: array) -> StateMetadata | None:
    if not states:
        return None
    columns = _host_tensor(states, torch.int64).view(-1, 4).t()
    return StateMetadata(columns[0].contiguous(), columns[1].bool(), columns[2].contiguous(), columns[3].contiguous())


def _host_tensor(values: array, dtype: torch.dtype) -> torch.Tensor:
    """The array's memory as a host tensor (it keeps the array alive); ``run`` moves it to the device."""
    return torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


def _append_slots(slots: array, table: list[int], start: int, end: int, block_size: int) -> None:
    """The slots of positions [start, end), one run of consecutive slots per block touched."""
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        run = min(end - pos, block_size - offset)
        first = table[block] * block_size + offset
        slots.extend(range(first, first + run))
        pos += run


def _new_pool(num_blocks: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """On CUDA zeroed, so masked-out lanes a kernel reads never hold NaNs. On CPU the
    kernels read only written slots, and an untouched ``empty`` pool costs no RAM
    until blocks are used (a pool sized for the worst case stays cheap)."""
    if device.type == "cuda":
        return torch.zeros((num_blocks, *shape), dtype=dtype, device=device)
    return torch.empty((num_blocks, *shape), dtype=dtype)


def _cpu_pool(num_blocks: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The swap pool; swap-ins only read blocks a swap-out wrote, so it needs no zeroing."""
    return torch.empty((num_blocks, *shape), dtype=dtype, device="cpu",
                       pin_memory=device.type == "cuda" and num_blocks > 0)


# A state move's (source pool, destination pool) of a (device, CPU) pair.
_STATE_MOVES = {"copy": lambda dev, cpu: (dev, dev), "swap_out": lambda dev, cpu: (dev, cpu),
                "swap_in": lambda dev, cpu: (cpu, dev)}
_NO_PAIRS = torch.empty(0, 2, dtype=torch.int64)
_NO_ROWS = torch.empty(0, dtype=torch.int64)
# Prompt rows whose logits exist at once: 512 x a 128k vocabulary in fp32 is 256 MiB (and as much for log_softmax).
_PROMPT_ROWS_PER_PASS = 512


def _mapping(pairs: list[tuple[int, int]]) -> torch.Tensor:
    # Most steps move no blocks: skip torch.tensor's ~3 us for each of the three empty lists.
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2) if pairs else _NO_PAIRS

