"""Async scheduling (``EngineConfig.async_scheduling``): the engine's step in flight and the one scheduled behind it.

Step N's forward pass runs on one worker thread (torch ops release the GIL; on CUDA the worker only launches
kernels). Meanwhile the engine thread schedules step N+1 as if every sequence sampled in N had its token: a
placeholder token stands in for it, so the scheduler claims its slot exactly as for any decode, and N+1's inputs
are planned with the placeholder's row left to fill. Once N's tokens are drawn, N+1 is queued on the worker, which
copies them into those rows first; then the engine processes N's outputs (stops, frees, ``RequestOutput``s) while
N+1 runs. A sequence that N finishes still runs its N+1 row; the scheduler ignores that row's token, as it does
any token of a sequence no longer running. ``runs_ahead`` and ``Scheduler.can_schedule_ahead`` say when N+1 must
wait for N's tokens on the host instead (docs/engine.md).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.model_runner import Logits, ModelRunner, StepPlan
from engine.sequence import SequenceStatus
from engine.step_inputs import TokenFill

# The input id of a token not sampled yet: never read (``TokenFill`` overwrites it before the forward pass).
PLACEHOLDER = -1


@dataclass(slots=True)
class InFlight:
    """A launched step and its logits to come."""

    out: SchedulerOutput
    logits: Future[Logits | None]


@dataclass(slots=True)
class Ahead:
    """The step scheduled behind the one in flight: its plan, and which of its input rows (``rows``) take which
    of the in-flight step's sampled tokens (``sources``, indices into its ``samples()``)."""

    out: SchedulerOutput
    plan: StepPlan
    rows: torch.Tensor
    sources: torch.Tensor


def runs_ahead(out: SchedulerOutput, constrained: bool, speculative: bool = False) -> bool:
    """Whether the step after ``out`` may be scheduled before ``out``'s tokens are known: not while a
    structured-output request is live (its next mask needs the token), nor after a step of requests that
    speculate (their next proposals follow this step's tokens, and a verification emits several), with beam
    candidates (a beam step reshapes the group), a fork of n > 1 samples (the children appear on the host) or
    prompt logprobs."""
    if constrained or speculative:
        return False
    return not any(s.forks or s.group.params.use_beam_search or s.group.params.prompt_logprobs is not None
                   for s in out.scheduled)


class StepPipeline:
    """Owns the forward-pass worker and the step in flight."""

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        # The worker's torch ops use the engine's thread count (a new thread would start from the default).
        self._worker = ThreadPoolExecutor(1, "pagedserve-forward", torch.set_num_threads, (torch.get_num_threads(),))
        self.in_flight: InFlight | None = None

    def launch(self, out: SchedulerOutput, plan: StepPlan) -> None:
        self.in_flight = InFlight(out, self._worker.submit(self._runner.run, plan))

    def launch_ahead(self, ahead: Ahead, tokens: torch.Tensor | None) -> torch.Tensor | None:
        """Queue the step scheduled ahead; ``tokens``: the step before's, in its ``samples()`` order (None: it
        sampled nothing). Returns them on the host: on CUDA their copy is queued before that step, so waiting
        for it (here) never waits for the step."""
        host, copied = tokens, None
        if tokens is not None and tokens.is_cuda:
            host = tokens.to("cpu", non_blocking=True)  # into pinned memory
            copied = torch.cuda.Event()
            copied.record()
        fill = TokenFill(ahead.rows, ahead.sources, tokens) if ahead.rows.numel() else None  # read on the device
        self.in_flight = InFlight(ahead.out, self._worker.submit(self._runner.run, ahead.plan, fill))
        if copied is not None:
            copied.synchronize()
        return host

    def take(self) -> InFlight:
        step, self.in_flight = self.in_flight, None
        return step

    def schedule_ahead(self, scheduler: Scheduler, current: SchedulerOutput) -> Ahead | None:
        """Schedule and plan the step after ``current`` (in flight, its K/V marked computed here), or None
        when that could preempt."""
        pending = {seq.seq_id: i for i, (_, _, seq) in enumerate(current.samples())
                   if seq.status is SequenceStatus.RUNNING}
        if not scheduler.can_schedule_ahead(pending.keys()):
            return None
        scheduler.mark_computed(current, register=False)
        held = [seq for _, _, seq in current.samples() if seq.seq_id in pending]
        for seq in held:
            seq.token_ids.append(PLACEHOLDER)
        try:
            out = scheduler.schedule()
            plan = self._runner.plan(out)
        finally:
            for seq in held:  # the token comes with current's update, as without async scheduling
                seq.token_ids.pop()
        rows, sources, row = [], [], 0
        for s in out.scheduled:  # a held sequence's one schedulable token is its placeholder
            if (i := pending.get(s.seq.seq_id)) is not None:
                rows.append(row)
                sources.append(i)
            row += s.num_new_tokens
        return Ahead(out, plan, torch.tensor(rows, dtype=torch.int64), torch.tensor(sources, dtype=torch.int64))
