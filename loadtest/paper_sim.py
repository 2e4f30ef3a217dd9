"""Drive the real Scheduler and KV allocator over a trace in simulated time.

Nothing here models memory: every admission, block, run, fork and
fragmentation figure comes from the engine's own ``Scheduler`` and KV manager.
Only the forward pass and the sampler are replaced: each step costs a fixed
``step_time_s`` (taken from a measured real forward pass) and draws arbitrary
tokens, which go through the engine's own post-step
(``Scheduler.update_from_output``: forks, stops, frees), so a memory-bound
serving run of thousands of requests takes seconds. Requests use
``ignore_eos`` semantics: each generates exactly ``max_tokens`` tokens. A beam
search request gets random next-token distributions (``BEAM_VOCAB`` tokens,
standard-normal logits) for its candidates, and the engine's own beam step
forks and frees them on the real block tables.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.beam_search import TopTokens, num_kept
from engine.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class TraceRequest:
    arrival: float  # seconds from the start of the run
    prompt: list[int]
    max_tokens: int  # the true output length (ignore_eos)
    n: int = 1
    beam_width: int = 0  # > 0: a beam search of this width (returning its best hypothesis)


BEAM_VOCAB = 64  # tokens of the random distributions a beam search's candidates draw from


@dataclass(slots=True)
class MemoryMeter:
    """Sums of per-step KV figures, in token slots (one sample per forward pass)."""

    steps: int = 0
    saturated_steps: int = 0  # steps at which requests were waiting: memory is the bottleneck
    batch_sum: int = 0  # running requests, over saturated steps
    peak_batch: int = 0
    slots: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("stored", "reserved", "internal", "external", "free"), 0))
    track_sharing: bool = False  # count unshared blocks too (costs a pass over every block table)
    used_blocks: int = 0  # with sharing, over every step
    unshared_blocks: int = 0  # what the same block tables would take without sharing

    def observe(self, sched: Scheduler) -> bool:
        """Sample the KV state during this step's forward pass; True if requests wait."""
        self.steps += 1
        self.peak_batch = max(self.peak_batch, len(sched.running))
        if self.track_sharing:
            self.used_blocks += sched.kv.stats().num_used_blocks
            self.unshared_blocks += sum(len(ids) for ids in _block_tables(sched))
        if not sched.waiting:
            return False
        kv = sched.kv.stats()
        self.saturated_steps += 1
        self.batch_sum += len(sched.running)
        for key, value in (("stored", kv.num_tokens_stored), ("reserved", kv.num_reserved_slots),
                           ("internal", kv.num_internal_frag_slots), ("external", kv.num_external_frag_slots),
                           ("free", kv.num_free_slots)):
            self.slots[key] += value
        return True

    def breakdown(self) -> dict[str, float]:
        """Shares of the taken (non-free) KV memory, averaged over saturated steps."""
        taken = sum(v for k, v in self.slots.items() if k != "free")
        return {k: v / taken for k, v in self.slots.items() if k != "free"} if taken else {}

    @property
    def mean_batch(self) -> float:
        return self.batch_sum / self.saturated_steps if self.saturated_steps else 0.0

    @property
    def sharing_saving(self) -> float:
        """Share of blocks that sharing saves: 1 - used / unshared."""
        return 1 - self.used_blocks / self.unshared_blocks if self.unshared_blocks else 0.0


def _block_tables(sched: Scheduler) -> list[list[int]]:
    return [sched.kv.block_ids(s.seq_id) for g in sched.running.values() for s in g.seqs_with(SequenceStatus.RUNNING)]


@dataclass(slots=True)
class SimResult:
    num_requests: int
    num_failed: int
    duration_s: float
    num_steps: int
    normalized_latency_s: float  # mean over requests of e2e latency / output tokens
    throughput_rps: float  # over the whole run
    saturated_rps: float  # completions per second while requests wait: the rate it sustains
    output_tokens_per_s: float
    mean_batch: float  # running requests per step while requests wait
    peak_batch: int
    breakdown: dict[str, float]
    sharing_saving: float

    @property
    def sustained_rps(self) -> float:
        """The saturated rate; when no request ever waited, the whole-run rate (a lower bound)."""
        return self.saturated_rps or self.throughput_rps


class Simulation:
    def __init__(self, config: EngineConfig, trace: list[TraceRequest], step_time_s: float, seed: int = 0,
                 track_sharing: bool = False) -> None:
        self.sched = Scheduler(SchedulerConfig.without_model(config))
        self._groups: dict[str, SequenceGroup] = {}  # the requests in flight
        self.pending = deque(sorted(trace, key=lambda r: r.arrival))
        self.step_time_s = step_time_s
        self.now = 0.0
        self.meter = MemoryMeter(track_sharing=track_sharing)
        self._rng = random.Random(seed)
        self._beam_rng = torch.Generator().manual_seed(seed)
        self._latencies: list[float] = []
        self._output_tokens = 0
        self._failed = 0
        self._saturated = False  # whether the current step has requests waiting
        self._saturated_done = 0  # requests finished in such steps

    def run(self) -> SimResult:
        num_requests = len(self.pending)
        while self.pending or self.sched.has_unfinished():
            self._arrive()
            if not self.sched.has_unfinished():
                self.now = self.pending[0].arrival
                continue
            self._step()
        m = self.meter
        done = len(self._latencies)
        saturated_s = m.saturated_steps * self.step_time_s
        return SimResult(
            num_requests, self._failed, self.now, m.steps,
            sum(self._latencies) / done if done else float("inf"),
            done / self.now if self.now else 0.0, self._saturated_done / saturated_s if saturated_s else 0.0,
            self._output_tokens / self.now if self.now else 0.0,
            m.mean_batch, m.peak_batch, m.breakdown(), m.sharing_saving)

    def _arrive(self) -> None:
        while self.pending and self.pending[0].arrival <= self.now:
            r = self.pending.popleft()
            params = SamplingParams(n=r.n, max_tokens=r.max_tokens, ignore_eos=True)
            if r.beam_width:
                params = SamplingParams(best_of=r.beam_width, use_beam_search=True, temperature=0.0,
                                        max_tokens=r.max_tokens, ignore_eos=True)
            seq = Sequence(list(r.prompt), len(r.prompt))
            group = self._groups[f"r{seq.seq_id}"] = SequenceGroup(f"r{seq.seq_id}", [seq], params, r.arrival)
            self.sched.add_group(group)

    def _step(self) -> None:
        out = self.sched.schedule()
        self._failed += len(out.failed)
        self._saturated = self.meter.observe(self.sched)
        self.now += self.step_time_s
        tokens = [self._rng.randrange(32000) for _ in out.samples()]
        beams = len(out.beam_samples())
        rows = None
        if beams:
            logprobs = torch.randn(beams, BEAM_VOCAB, generator=self._beam_rng).log_softmax(-1)
            rows = TopTokens.of(logprobs, max(num_kept(s.group.params, self.sched.eos_token_ids)
                                              for _, s in out.beam_samples()))
        for output in self.sched.update_from_output(out, SamplerOutput(tokens, [None] * len(tokens), rows)):
            if output.finished:
                self._finished(self._groups.pop(output.request_id))

    def _finished(self, group: SequenceGroup) -> None:
        self._output_tokens += sum(s.num_output_tokens for s in group.seqs)
        self._latencies.append((self.now - group.arrival_time) / group.params.max_tokens)
        self._saturated_done += self._saturated


def simulate(config: EngineConfig, trace: list[TraceRequest], step_time_s: float, seed: int = 0,
             track_sharing: bool = False) -> SimResult:
    return Simulation(config, trace, step_time_s, seed, track_sharing).run()
