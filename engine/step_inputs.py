"""A step's input tensors packed back to back in one buffer, so the host builds them in place and they reach the
device in one copy: on CUDA a pinned host buffer and its device twin, on CPU the host buffer alone. The same
packing pads a decode step to a larger batch (``engine.cuda_graphs``): a pad sequence has one token, which stores
nowhere (slot -1) and attends to one key. With async scheduling some input ids arrive on the device after the
step was planned (``TokenFill``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.attention import AttentionMetadata


@dataclass(slots=True)
class StepTensors:
    """The model's inputs and the rows to sample, all views of one buffer."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor


@dataclass(slots=True)
class TokenFill:
    """Input rows whose tokens were not sampled yet when their step was planned (async scheduling): row
    ``rows[i]`` takes ``tokens[sources[i]]``, ``tokens`` being the step before's sampled tokens, on the device."""

    rows: torch.Tensor
    sources: torch.Tensor
    tokens: torch.Tensor

    def apply(self, input_ids: torch.Tensor) -> None:
        """Into the step's ``input_ids`` where the forward pass reads them: no round trip through the host."""
        picked = self.tokens.index_select(0, self.sources.to(self.tokens.device))
        input_ids.index_copy_(0, self.rows.to(input_ids.device), picked.to(input_ids.device, input_ids.dtype))


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Byte offsets of a step of ``tokens`` rows, ``seqs`` sequences and block tables ``width`` wide: the int64
    token fields, the int32 sequence fields, then the sample rows (last, so the other fields' places do not
    depend on how many rows sample: a captured graph keeps reading the same addresses)."""

    tokens: int
    seqs: int
    width: int
    samples: int

    @property
    def int32_start(self) -> int:
        return 3 * self.tokens * 8

    @property
    def samples_start(self) -> int:
        return _align8(self.int32_start + (2 * self.seqs + 1 + self.seqs * self.width) * 4)

    @property
    def nbytes(self) -> int:
        return self.samples_start + self.samples * 8

    def views(self, buffer: torch.Tensor, max_query_len: int, max_seq_len: int) -> StepTensors:
        t, s = self.tokens, self.seqs
        tokens = buffer[:self.int32_start].view(torch.int64).view(3, t)
        ints = buffer[self.int32_start:self.samples_start].view(torch.int32)
        meta = AttentionMetadata(slot_mapping=tokens[2],
                                 block_tables=ints[2 * s + 1:2 * s + 1 + s * self.width].view(s, self.width),
                                 seq_lens=ints[:s], query_start_loc=ints[s:2 * s + 1], max_query_len=max_query_len,
                                 max_seq_len=max_seq_len)
        return StepTensors(tokens[0], tokens[1], meta, buffer[self.samples_start:self.nbytes].view(torch.int64))


class StepBuffers:
    """Owns one step's packed inputs. ``load`` fills the host buffer and starts its one copy to the device;
    the next ``load`` first waits for that copy, since it rewrites the same host memory."""

    def __init__(self, device: torch.device, nbytes: int = 0) -> None:
        self.device = device
        self._host = self._device = torch.empty(0, dtype=torch.uint8)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.reserve(nbytes)

    def reserve(self, nbytes: int) -> None:
        """Room for ``nbytes``; growing moves the buffers, so a captured graph's buffers are reserved up front."""
        if nbytes <= self._host.numel():
            return
        nbytes = max(nbytes, 2 * self._host.numel())
        cuda = self.device.type == "cuda"
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self._device = torch.empty(nbytes, dtype=torch.uint8, device=self.device) if cuda else self._host

    def views(self, layout: StepLayout, max_query_len: int, max_seq_len: int) -> StepTensors:
        """``layout``'s fields on the device (what a captured graph reads)."""
        return layout.views(self._device, max_query_len, max_seq_len)

    def load(self, layout: StepLayout, step: StepTensors) -> StepTensors:
        """``step`` (host tensors) packed at ``layout``, the rows and sequences past its own padded, on the
        device. Pads: token 0 at position 0, slot -1, one query row and a seq_len of 1 each, block 0."""
        meta = step.meta
        n, s, w = len(step.input_ids), len(meta.seq_lens), meta.block_tables.shape[1]
        if layout.tokens - n != layout.seqs - s or w > layout.width or len(step.sample_rows) != layout.samples:
            raise ValueError(f"a step of {n} tokens, {s} seqs and tables {w} wide does not fit {layout}")
        self.reserve(layout.nbytes)
        if self._copied is not None:
            self._copied.synchronize()
        host = layout.views(self._host, meta.max_query_len, meta.max_seq_len)
        m = host.meta
        _fill(host.input_ids, step.input_ids, 0)
        _fill(host.positions, step.positions, 0)
        _fill(m.slot_mapping, meta.slot_mapping, -1)
        _fill(m.seq_lens, meta.seq_lens, 1)
        m.query_start_loc[:s + 1].copy_(meta.query_start_loc)
        torch.arange(n + 1, n + 1 + layout.seqs - s, out=m.query_start_loc[s + 1:])
        m.block_tables[:s, :w].copy_(meta.block_tables)  # columns past w are never read: their seq_lens stop short
        m.block_tables[s:].fill_(0)
        host.sample_rows.copy_(step.sample_rows)
        if self._copied is None:
            return host
        self._device[:layout.nbytes].copy_(self._host[:layout.nbytes], non_blocking=True)
        self._copied.record()
        return self.views(layout, meta.max_query_len, meta.max_seq_len)


def _fill(dst: torch.Tensor, src: torch.Tensor, pad: int) -> None:
    dst[:len(src)].copy_(src)
    dst[len(src):].fill_(pad)


def _align8(n: int) -> int:
    return -(-n // 8) * 8
