"""The step plan on the wire: rank 0 packs a ``StepPlan`` (block moves + flattened batch) into one int64 tensor
with a fixed-size header and broadcasts it on the gloo control group; the other ranks unpack the same tensors.
Plain integers only, no pickle: the header gives every field's length, the payload holds them back to back."""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.distributed.parallel_state import TensorParallel
from engine.core.state_cache import StateMove
from engine.layers.attention import AttentionMetadata, StateMetadata
from engine.model_runner import Batch, StepPlan

# kind, payload length, then the counts; kind 0 tells the workers to stop.
_HEADER_LEN = 15
_STOP, _STEP = 0, 1
_MOVE_KINDS = ("copy", "swap_out", "swap_in")  # a hybrid model's state moves, by index


def send_plan(tp: TensorParallel, plan: StepPlan | None) -> None:
    """Rank 0: broadcast this step's plan (None: stop the workers)."""
    header, payload = _encode(plan)
    dist.broadcast(header, 0, group=tp.control)
    if payload.numel():
        dist.broadcast(payload, 0, group=tp.control)


def receive_plan(tp: TensorParallel) -> StepPlan | None:
    """Other ranks: wait for rank 0's next plan (None: stop)."""
    header = torch.empty(_HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, 0, group=tp.control)
    h = header.tolist()
    if h[0] == _STOP:
        return None
    payload = torch.empty(h[1], dtype=torch.int64)
    if h[1]:
        dist.broadcast(payload, 0, group=tp.control)
    return _decode(h, payload)


def _encode(plan: StepPlan | None) -> tuple[torch.Tensor, torch.Tensor]:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    if plan is None:
        return header, header[:0]
    moves = [(_MOVE_KINDS.index(m.kind), m.src, m.dst) for m in plan.state_moves]
    parts = [plan.swap_out, plan.swap_in, plan.copies, torch.tensor(moves, dtype=torch.int64).view(-1)]
    counts = [len(plan.swap_out), len(plan.swap_in), len(plan.copies), len(moves), 0, 0, 0, 0, 0, 0, 0, 0, 0]
    b = plan.batch
    if b is not None:
        m = b.meta
        parts += [b.input_ids, b.positions, m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc,
                  b.sample_rows, b.prompt_rows]
        counts[4:] = [1, len(b.input_ids), len(m.seq_lens), m.block_tables.shape[1], len(b.sample_rows),
                      m.max_query_len, m.max_seq_len, len(b.prompt_rows), m.state is not None]
        if m.state is not None:
            parts += [m.state.slots, m.state.has_initial, m.state.save_slots, m.state.save_offsets]
    payload = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])
    header[0], header[1] = _STEP, payload.numel()
    header[2:] = torch.tensor(counts)
    return header, payload


def _decode(h: list[int], payload: torch.Tensor) -> StepPlan:
    (n_out, n_in, n_copy, n_moves, has_batch, tokens, seqs, width, samples, max_query_len, max_seq_len,
     prompt_rows, has_state) = h[2:]
    sizes = [2 * n_out, 2 * n_in, 2 * n_copy, 3 * n_moves]
    if has_batch:
        sizes += [tokens, tokens, tokens, seqs * width, seqs, seqs + 1, samples, prompt_rows] + [seqs] * 4 * has_state
    parts = payload.split(sizes)
    swap_out, swap_in, copies = (p.view(-1, 2) for p in parts[:3])
    moves = [StateMove(_MOVE_KINDS[kind], src, dst) for kind, src, dst in parts[3].view(-1, 3).tolist()]
    batch = None
    if has_batch:
        ids, positions, slots, tables, seq_lens, qsl, sample_rows, prompt_row_ids = parts[4:12]
        state = StateMetadata(parts[12], parts[13].bool(), parts[14], parts[15]) if has_state else None
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables.view(seqs, width).to(torch.int32),
                                 seq_lens=seq_lens.to(torch.int32), query_start_loc=qsl.to(torch.int32),
                                 max_query_len=max_query_len, max_seq_len=max_seq_len, state=state)
        batch = Batch(ids, positions, meta, sample_rows, prompt_rows=prompt_row_ids)  # targets: rank 0's only
    return StepPlan(swap_out=swap_out, swap_in=swap_in, copies=copies, batch=batch, state_moves=moves)
