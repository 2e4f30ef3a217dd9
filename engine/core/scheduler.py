"""Iteration-level scheduler over the KV cache, by priority then arrival (docs/architecture.md §4).

The KV allocator is the paged one or, for the paper's baselines, a contiguous
one (``SchedulerConfig.kv_allocator``): the same policy runs on both; a
contiguous allocator reserves everything at admission, so its running groups
never need blocks and are never preempted.

Every queue is kept in *rank* order: priority (lower first; 0 by default, so
all equal: plain FCFS), then arrival. Each step: running groups first (decodes
and continued prefill chunks, in rank order), then swapped groups back in, then
new admissions from the waiting queue (before the swapped ones only when the
waiting head has the higher priority), all under ``max_num_batched_tokens`` and
``max_num_seqs``. When a running group needs blocks that are not free, the
last-ranked running group (lowest priority, latest arrival) is preempted
whole: swapped to the CPU pool in ``swap`` mode (when it fits), otherwise
recomputed. A step whose running groups preempted neither swaps in nor admits,
so memory pressure is not immediately re-created. A waiting group that does not
fit preempts running groups of strictly lower priority first, last-ranked
first, and is admitted in the same step.

Recompute of a group with several (diverged) sequences: every sequence goes
back to WAITING and re-prefills its own full token list; the group is
admitted all-or-nothing and prefix caching dedupes the shared prompt blocks.
A resumed request (another engine ran it and died) enters the same way: its
choices, each holding the tokens already delivered, re-prefill like a
recomputed group's. A beam search (``engine/beam_search.py``) is one group
of its live candidates, scheduled and preempted as one like the n samples; it
advances once every candidate has a next-token distribution.

Speculative decoding: a running decode carries its sequence's proposed tokens (``Sequence.draft_token_ids``)
as far as the budget allows, dropped rather than preempt anyone when blocks are short; ``update_from_output``
accepts them up to the first disagreement with the sampled tokens and truncates the rest (docs/engine.md).

After the forward pass, ``update_from_output`` is the one post-step. When a
step fails, ``recover_failed_step`` redoes what it may not have done, and
``isolate`` turns a failed batch's groups into suspects: preempted by
recompute, each then runs alone (oldest first) until it has caught up, so
one poisonous request fails alone, never its batch-mates.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping, Set
from itertools import islice

from engine.baselines import ContiguousKVCacheManager
from engine.beam_search import BeamSearches, TopTokens
from engine.core.grammar import StructuredOutputManager
from engine.core.kv_allocator import Admission, KVAllocator, SeqSize
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_snapshot import NO_OWNER, KVSnapshot, SnapshotRequest
from engine.core.pooling import PoolingTracker
from engine.core.prompt_logprobs import PromptLogprobTracker
from engine.core.request_output import request_output, with_new_tokens
from engine.core.scheduler_config import SchedulerConfig
from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput, wants_prompt_logprobs
from engine.core.speculation import Speculation, SpecTarget
from engine.core.state_cache import StateCache
from engine.multimodal.block_keys import ImageBlockKeys, image_block_ids
from engine.multimodal.encoder_budget import EncoderBudget
from engine.outputs import RequestOutput, TokenLogprobs
from engine.sampler import SamplerOutput
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.stats import EngineStats

logger = logging.getLogger(__name__)

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
SWAPPED = SequenceStatus.SWAPPED
_NEW_STATUSES = (WAITING, SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH)
MAX_WAITING_LISTED = 256  # waiting requests a KV snapshot lists (they hold no blocks; the stats count them all)


def _pending_forks(group: SequenceGroup) -> int:
    """Sequences a group of n samples (or beam candidates) has yet to fork (forks follow the prompt)."""
    return group.params.num_seqs - len(group.seqs)


def _attach_drafts(s: ScheduledSeq, drafts: list[int], room: int) -> None:
    """Put the sequence's proposed tokens on its decode, as many as ``room`` tokens of budget allow."""
    if s.do_sample and s.num_new_tokens == 1 and room > 0:
        s.draft_token_ids = tuple(drafts[:room])
        s.num_new_tokens += len(s.draft_token_ids)


def _drop_drafts(plan: list[ScheduledSeq]) -> int:
    """Plain decodes again, the plan's drafts dropped (memory is tight); returns how many tokens that saves."""
    dropped = 0
    for s in plan:
        dropped += len(s.draft_token_ids)
        s.num_new_tokens -= len(s.draft_token_ids)
        s.draft_token_ids = ()
    return dropped


def make_kv_allocator(config: SchedulerConfig) -> KVAllocator:
    if config.kv_allocator == "paged":
        state = StateCache(config.num_state_slots, config.num_state_snapshots, config.num_cpu_state_slots,
                           config.block_size) if config.num_state_slots else None
        return KVCacheManager(config.num_device_blocks, config.num_cpu_blocks,
                              config.block_size, config.enable_prefix_caching, config.sliding_window, state)
    if config.num_state_slots:
        raise ValueError(f"a hybrid recurrent-state model needs kv_allocator='paged', not {config.kv_allocator!r}")
    if config.enable_prefix_caching:
        logger.info("prefix caching is off: the %s allocator shares no blocks (paged only)", config.kv_allocator)
    if config.num_cpu_blocks:
        logger.info("swap space unused: the %s allocator reserves at admission and never preempts",
                    config.kv_allocator)
    if config.max_model_len is None:
        raise ValueError(f"the {config.kv_allocator} allocator needs max_model_len")
    return ContiguousKVCacheManager(config.num_device_blocks, config.block_size, config.kv_allocator,
                                    config.max_model_len)


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_token_ids: Iterable[int] = (),
                 grammar: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = make_kv_allocator(config)
        self._hybrid = config.num_state_slots > 0  # recurrent state slots follow the sequences (state_cache.py)
        # The request registry: every unfinished request (WAITING_FOR_GRAMMAR, then in one of the queues
        # below), and the finished ones (or a resumed request's choices that ended on arrival) not reported yet.
        self.requests: dict[str, SequenceGroup] = {}
        self._unreported: list[tuple[SequenceGroup, list[Sequence], str | None]] = []  # (group, its ended, error)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: dict[str, SequenceGroup] = {}  # rank order; the last is the next victim
        self.swapped: deque[SequenceGroup] = deque()  # rank order
        self._arrivals = itertools.count()
        self.suspects: deque[SequenceGroup] = deque()  # of a failed batch, to run alone, oldest first
        # The features' per-request state, each in its own map.
        self.grammar = grammar
        self.beams = BeamSearches(self.eos_token_ids, config.max_model_len)
        self.speculation = Speculation(config.num_speculative_tokens, config.max_model_len)
        self.prompt_logprobs = PromptLogprobTracker()
        self.pooling = PoolingTracker()
        self._num_running_seqs = 0
        self._num_pending_forks = 0  # seats running groups keep for their n samples
        self.num_preemptions = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_prompt_tokens = 0  # of every group added
        self.num_generated_tokens = 0
        self.encoder_budget: EncoderBudget | None = None  # a vision-language model's, set by the engine

    # -- requests ------------------------------------------------------------
    def add_group(self, group: SequenceGroup) -> None:
        """Register a new request: one WAITING sequence, or a resumed one (``LLMEngine.add_request(resume=)``):
        its n choices with their output tokens, each WAITING or finished, as after a recompute preemption.
        A resumed choice whose tokens already meet its stop condition finishes here (reported with the next
        outputs); a group left with nothing to run is not queued. A constrained request waits for its grammar."""
        self.check_new(group)
        finished_before = [seq.is_finished for seq in group.seqs]
        for seq in group.seqs:
            if seq.status is WAITING and seq.num_output_tokens:
                self._check_stop(group, seq, seq.token_ids[-1])
        ended = [seq for seq, was in zip(group.seqs, finished_before) if seq.is_finished and not was]
        if ended or group.is_finished:
            self._unreported.append((group, ended, None))
        self.num_prompt_tokens += group.seqs[0].num_prompt_tokens
        if group.is_finished:
            return
        self.requests[group.request_id] = group
        group.rank = (group.priority, next(self._arrivals))
        if group.params.use_beam_search:
            self.beams.start(group.request_id, group.params, group.seqs[0].num_prompt_tokens)
        if wants_prompt_logprobs(group, group.seqs[0]):
            self.prompt_logprobs.start(group.request_id)
        if group.pooling is not None:
            self.pooling.start(group.request_id)
        if group.params.structured_output is None:
            _insert(self.waiting, group)
            return
        for seq in group.seqs_with(WAITING):
            seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
        self.grammar.start(group)

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is ready, in arrival order; fail those whose grammar failed."""
        for group, error in self.grammar.ready():
            if error is not None:
                self._end(group, SequenceStatus.FINISHED_ERROR, f"structured_output: {error}")
                continue
            for seq in group.seqs_with(SequenceStatus.WAITING_FOR_GRAMMAR):
                seq.status = WAITING
            _insert(self.waiting, group)

    def check_new(self, group: SequenceGroup) -> None:
        """ValueError when ``add_group`` would refuse ``group`` (the engine asks before a grammar compiles)."""
        if group.request_id in self.requests or any(g.request_id == group.request_id for g, _, _ in self._unreported):
            raise ValueError(f"request id {group.request_id!r} is already in use")
        if group.params.structured_output is not None and self.grammar is None:
            raise ValueError("structured output needs a grammar manager (the engine's)")
        if group.params.num_seqs > 1 and self.config.kv_allocator != "paged":
            raise ValueError(f"a request of {group.params.num_seqs} sequences (n or beam width) shares KV "
                             f"blocks: it needs kv_allocator='paged', not {self.config.kv_allocator!r}")
        seqs, n = group.seqs, group.params.n
        if len(seqs) not in (1, n) or any(s.status not in _NEW_STATUSES for s in seqs):
            raise ValueError("a new group must hold one WAITING sequence, or (resumed) its n choices, "
                             "each WAITING or finished")
        if group.params.use_beam_search and (len(seqs) != 1 or seqs[0].num_output_tokens):
            raise ValueError("a beam search cannot be resumed (it publishes only once it is over)")
        if not seqs[0].num_prompt_tokens:
            raise ValueError("the prompt must contain at least one token")

    def abort(self, request_ids: str | Iterable[str]) -> list[SequenceGroup]:
        """Abort requests in any state; their blocks return to the pools, their ends come with the next outputs.
        Returns the groups it ended."""
        return self._end_requests([request_ids] if isinstance(request_ids, str) else request_ids,
                           SequenceStatus.FINISHED_ABORTED, None)

    def fail(self, request_ids: Iterable[str], error: str) -> None:
        """Fail requests in any state (FINISHED_ERROR, with ``error``), as ``abort`` does."""
        self._end_requests(request_ids, SequenceStatus.FINISHED_ERROR, error)

    def _end_requests(self, request_ids: Iterable[str], status: SequenceStatus, error: str | None
                      ) -> list[SequenceGroup]:
        groups = [self.requests[i] for i in dict.fromkeys(request_ids) if i in self.requests]
        for group in groups:
            self._end(group, status, error)
        return groups

    def _end(self, group: SequenceGroup, status: SequenceStatus, error: str | None) -> None:
        """Finish the group's unfinished sequences with ``status``; its one output to come says so (a resumed
        choice's end found on arrival and not reported yet is superseded)."""
        for seq in group.unfinished_seqs():
            self.finish_seq(group, seq, status)
        group.error = error
        if self._unreported:
            self._unreported = [u for u in self._unreported if u[0] is not group]
        self._unreported.append((group, group.seqs_with(status), error))

    def finish_seq(self, group: SequenceGroup, seq: Sequence, status: SequenceStatus) -> None:
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        if seq.is_finished:
            return
        if seq.status is RUNNING:
            self._num_running_seqs -= 1
        self.kv.free(seq.seq_id)
        self.speculation.forget(seq.seq_id)
        seq.status = status
        if group.is_finished:
            self._remove(group)

    def _remove(self, group: SequenceGroup) -> None:
        """A finished group leaves the registry, its queue and the features' maps."""
        self.requests.pop(group.request_id, None)
        self.beams.forget(group.request_id)
        if self.grammar is not None:
            self.grammar.forget(group)
        if self.suspects and group in self.suspects:
            self.suspects.remove(group)
        if self.running.pop(group.request_id, None) is not None:
            self._num_pending_forks -= _pending_forks(group)
        else:
            for queue in (self.waiting, self.swapped):
                if group in queue:
                    queue.remove(group)

    # -- the step ------------------------------------------------------------
    def schedule(self, drafts: Mapping[int, list[int]] | None = None) -> SchedulerOutput:
        """The next step. ``drafts``: tokens proposed to follow running sequences (by seq_id), for their decodes
        to verify (speculative decoding, ``speculation_targets``); dropped where the budget or memory is short."""
        if self.grammar is not None and self.grammar.compiling:
            self._admit_compiled()
        out = SchedulerOutput()
        if self.encoder_budget is not None:  # images: a fresh encoder budget per step
            self.encoder_budget.new_step()
        while self.suspects and self._caught_up(self.suspects[0]):
            self.suspects.popleft()  # its solo steps succeeded: back to normal batching
        if self.suspects:
            self._schedule_suspect(out)
        else:
            self._schedule_batch(out, drafts or {})
        if self.grammar is not None and self.grammar.active and out.scheduled:
            out.token_mask = self.grammar.mask(out.samples())
        if self._hybrid:
            out.state_moves = self.kv.state.take_moves()
        return out

    def speculation_targets(self) -> list[SpecTarget]:
        """The running sequences to propose tokens for this step, and how many each."""
        return self.speculation.targets(self.running.values()) if self.speculation.k else []

    def _schedule_batch(self, out: SchedulerOutput, drafts: Mapping[int, list[int]]) -> None:
        self._preempt_for_priority(out)
        by_priority = len(out.preempted)
        # A step that admits a request of higher priority leaves the lower-priority groups out: its first
        # token waits for no decode of theirs. They run as usual if it is not admitted after all.
        head = self.waiting[0] if self._priority_preemption_possible() else None
        running = list(self.running.values())
        cut = len(running) if head is None else next(i for i, g in enumerate(running) if g.priority > head.priority)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, running[:cut], drafts)
        if len(out.preempted) == by_priority:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped or self._waiting_outranks_swapped():
                budget = self._schedule_waiting(out, budget)
        if head is not None and head.request_id not in self.running:
            self._schedule_running(out, budget, running[cut:], drafts)

    def _waiting_outranks_swapped(self) -> bool:
        return bool(self.waiting) and bool(self.swapped) and self.waiting[0].priority < self.swapped[0].priority

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Preempt running groups of strictly lower priority than the waiting head, last-ranked first, until
        the head could be admitted (with this step's whole budget; the running groups' own needs come first,
        so a later step may preempt again)."""
        if not self._priority_preemption_possible():
            return
        head = self.waiting[0]
        if (self.swapped and self.swapped[0].priority <= head.priority) or self._admission_error(head) is not None:
            return  # a swapped group goes first (and is never swapped in where a victim was swapped out)
        seqs = head.seqs_with(WAITING)
        while self.running and next(reversed(self.running.values())).priority > head.priority:
            admissions, plan, _ = self._admission_plan(head, seqs, self.config.max_num_batched_tokens)
            if self._has_seats(head) and self._admissible(seqs, admissions, plan):
                return
            self._preempt(next(reversed(self.running.values())), out)

    def update_from_output(self, out: SchedulerOutput, sampled: SamplerOutput) -> list[RequestOutput]:
        """The one post-step, after the forward pass of ``out`` and the sampler's draw: record the prompt
        logprobs, verify the drafts, record the K/V (fork the n > 1 groups whose prompt is in), append the
        tokens, step the beam searches, feed the grammars, finish (and free) the sequences that stop. Returns
        the outputs: the requests that ended since the last step (aborted, failed), then those that got
        tokens (a beam search: once it is over), in schedule order."""
        now = time.time()
        for s in out.scheduled:
            s.group.metrics.first_scheduled_time = s.group.metrics.first_scheduled_time or now
        if sampled.prompt is not None:
            self.prompt_logprobs.record(out, sampled.prompt)  # first: the positions are read off the seqs' tokens
        samples = out.samples()
        if out.num_draft_tokens:
            self.speculation.verify(samples, sampled.token_ids, self.kv)
        self.mark_computed(out)
        groups = self._append_tokens(samples, sampled)
        if self.pooling:  # a CLS pooling's last chunk pools no rows, yet ends it
            for group in self.pooling.record(out, sampled.pooled):  # its prompt is in: it is over
                self.finish_seq(group, group.seqs[0], SequenceStatus.FINISHED_STOPPED)
                groups[group] = None
        if out.beam_samples():
            self._step_beams(out.beam_samples(), sampled.beam_tokens, groups)
        if self.grammar is not None and self.grammar.active:
            for group, seq, status in self.grammar.verdicts(samples):
                self.finish_seq(group, seq, status)
        return self.take_unreported() + [self._step_output(group, now) for group in groups]

    def _append_tokens(self, samples: list[tuple[int, ScheduledSeq, Sequence]], sampled: SamplerOutput
                       ) -> dict[SequenceGroup, None]:
        """Each running sequence's new token (a verification: its accepted drafts and the target's token);
        the groups that got tokens, an ordered set."""
        groups: dict[SequenceGroup, None] = {}
        for (_, s, seq), token, logprobs in zip(samples, sampled.token_ids, sampled.logprobs, strict=True):
            if s.draft_token_ids:  # a verification: its first 1 + num_accepted tokens are the sequence's
                if seq is not s.seq and len(seq.drafts) > s.num_accepted:
                    continue
                seq = s.seq
            if seq.status is RUNNING:  # not finished or aborted meanwhile
                seq.append_token(token, logprobs)
                self._check_stop(s.group, seq, token)
                groups[s.group] = None
                self.num_generated_tokens += 1
        return groups

    def _step_beams(self, samples: list[tuple[int, ScheduledSeq]], tokens: TopTokens,
                    groups: dict[SequenceGroup, None]) -> None:
        """Record the candidates' best tokens; each search whose candidates all have theirs takes its step
        (forks and drops candidates; once it is over, its best hypotheses become its sequences)."""
        for s in self.beams.record(samples, tokens):
            group, cands = s.group, s.group.seqs
            step = self.beams.step(self.kv, group.request_id, cands, group.prompt_token_ids, group.params.n)
            self.num_generated_tokens += len(cands)
            self._drop_candidates(step.dropped)  # their blocks' ref counts drop at once; those only they held are free
            if step.final is None:
                self._num_running_seqs += len(step.cands) - len(cands)
                self._num_pending_forks += len(cands) - len(step.cands)
                group.seqs = step.cands
                continue
            self._num_running_seqs -= len(cands)
            self._remove(group)
            group.seqs = step.final
            groups[group] = None

    def _drop_candidates(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.kv.free(seq.seq_id)
            seq.status = SequenceStatus.FINISHED_ABORTED

    def take_unreported(self) -> list[RequestOutput]:
        """The outputs of the requests (or resumed choices) that ended outside a step's tokens, once."""
        if not self._unreported:
            return []
        items, self._unreported = self._unreported, []
        return [request_output(group, seqs, error, self._prompt_logprobs(group), self._embedding(group))
                for group, seqs, error in items]

    def _step_output(self, group: SequenceGroup, now: float) -> RequestOutput:
        m = group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        if group.pooling is not None:  # its one output: the embedding
            return request_output(group, group.seqs, None, None, self._embedding(group))
        return request_output(group, with_new_tokens(group), None, self._prompt_logprobs(group))

    def _prompt_logprobs(self, group: SequenceGroup) -> list[TokenLogprobs | None] | None:
        return self.prompt_logprobs.take(group) if self.prompt_logprobs else None

    def _embedding(self, group: SequenceGroup) -> list[float] | None:
        return self.pooling.take(group) if self.pooling else None

    def mark_computed(self, out: SchedulerOutput, register: bool = True) -> None:
        """The forward pass wrote K/V for every scheduled token; then the forks share it. Async scheduling
        marks a step in flight early with ``register=False``: its blocks join the prefix cache only when it
        is done (``update_from_output`` marks it again, which changes nothing else), since it may fail."""
        mark_computed = self.kv.mark_computed
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not RUNNING:
                continue
            done = s.start + s.num_new_tokens - len(s.draft_token_ids) + s.num_accepted
            seq.num_computed_tokens = done
            mark_computed(seq.seq_id, done, seq.token_ids, register)
            for child in s.forks:
                self._fork(s.group, seq, child)

    def _fork(self, group: SequenceGroup, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks and takes a seat its group kept."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RUNNING
        group.seqs.append(child)
        self._num_running_seqs += 1
        self._num_pending_forks -= 1

    def _check_stop(self, group: SequenceGroup, seq: Sequence, token: int) -> None:
        p, max_len = group.params, self.config.max_model_len
        num_tokens = len(seq.token_ids)  # not the properties: this runs per sequence per step
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output >= p.min_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            self.finish_seq(group, seq, SequenceStatus.FINISHED_STOPPED)
        elif ((p.max_tokens is not None and num_output >= p.max_tokens)
              or (max_len is not None and num_tokens >= max_len)):
            self.finish_seq(group, seq, SequenceStatus.FINISHED_LENGTH)

    def _schedule_running(self, out: SchedulerOutput, budget: int, groups: list[SequenceGroup],
                          drafts: Mapping[int, list[int]]) -> int:
        """Each of ``groups`` (running, in rank order) that the budget and memory allow; the budget left."""
        kv = self.kv
        roomy = kv.fits_without_counting(budget, self._num_running_seqs)  # then every group fits: check none
        for group in groups:
            if budget <= 0 or group.request_id not in self.running:
                break  # a preempted victim: every later group went before it
            seqs = group.seqs if len(group.seqs) == 1 else group.seqs_with(RUNNING)
            plan, num_tokens = self._plan(group, seqs, budget, drafts)
            if not plan:
                continue
            if not roomy and not kv.fits_without_counting(num_tokens, len(plan)):  # tight: count exactly
                need = kv.num_new_blocks([(s.seq.seq_id, s.num_new_tokens) for s in plan])
                if need > kv.num_free_blocks and any(s.draft_token_ids for s in plan):  # drafts never preempt
                    num_tokens -= _drop_drafts(plan)
                    need = kv.num_new_blocks([(s.seq.seq_id, s.num_new_tokens) for s in plan])
                if need > kv.num_free_blocks and not self._make_room(group, need, out):
                    break
            self._commit(group, plan, out)
            budget -= num_tokens
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and not self._waiting_outranks_swapped():
            group = self.swapped[0]
            seqs = group.seqs_with(SWAPPED)
            plan, num_tokens = self._plan(group, seqs, budget)
            seq_ids = [s.seq_id for s in seqs]
            need = self.kv.num_new_blocks([(s.seq.seq_id, s.num_new_tokens) for s in plan])
            need += self.kv.num_blocks_of(seq_ids)
            if need > self.kv.num_blocks:
                self._fail(self.swapped.popleft(), f"needs {need} KV blocks, the pool has {self.kv.num_blocks}", out)
                continue
            seats = self._num_running_seqs + self._num_pending_forks + len(seqs) + _pending_forks(group)
            if not plan or need > self.kv.num_free_blocks or seats > self.config.max_num_seqs:
                break
            self.swapped.popleft()
            mapping = self.kv.swap_in(seq_ids)
            out.blocks_to_swap_in.extend(mapping)
            self.num_swapped_in_blocks += len(mapping)
            self._set_running(group, seqs)
            self._commit(group, plan, out)
            budget -= num_tokens
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0:
            group = self.waiting[0]
            error = self._admission_error(group)
            if error is not None:
                self._fail(self.waiting.popleft(), error, out)
                continue
            seqs = group.seqs_with(WAITING)
            if not self._has_seats(group):
                break
            admissions, plan, left = self._admission_plan(group, seqs, budget)
            if not self._admissible(seqs, admissions, plan):
                break
            self.waiting.popleft()
            self._admit(group, seqs, admissions)
            self._commit(group, plan, out)
            budget = left
        return budget

    def _schedule_suspect(self, out: SchedulerOutput) -> None:
        """The oldest suspect's step, alone: the other running groups (last-ranked first) make room if needed."""
        group, budget = self.suspects[0], self.config.max_num_batched_tokens
        if group.request_id in self.running:  # its re-prefill goes on in chunks
            plan, _ = self._plan(group, group.seqs_with(RUNNING), budget)
            need = self.kv.num_new_blocks([(s.seq.seq_id, s.num_new_tokens) for s in plan])
            while need > self.kv.num_free_blocks and self._preempt_other(group, out):
                pass
            self._commit(group, plan, out)
            return
        error = self._admission_error(group)
        if error is not None:
            self.waiting.remove(group)
            self.suspects.popleft()
            self._fail(group, error, out)
            return
        seqs = group.seqs_with(WAITING)
        while True:
            admissions, plan, _ = self._admission_plan(group, seqs, budget)
            if self._has_seats(group) and self._admissible(seqs, admissions, plan):
                break
            if not self._preempt_other(group, out):
                return  # unreachable: alone, a group that passes _admission_error fits
        self.waiting.remove(group)
        self._admit(group, seqs, admissions)
        self._commit(group, plan, out)

    def _preempt_other(self, group: SequenceGroup, out: SchedulerOutput) -> bool:
        """Preempt the last-ranked running group other than ``group``; False if there is none."""
        victim = next((g for g in reversed(self.running.values()) if g is not group), None)
        if victim is not None:
            self._preempt(victim, out)
        return victim is not None

    def _caught_up(self, group: SequenceGroup) -> bool:
        """Running with every known token's K/V but the sampled last one: its re-prefill is over."""
        return group.request_id in self.running and all(
            seq.num_computed_tokens >= seq.num_tokens - 1 for seq in group.seqs_with(RUNNING))

    def can_schedule_ahead(self, pending: Set[int]) -> bool:
        """Whether the next ``schedule`` certainly preempts nothing once the step in flight is done, the seqs
        ``pending`` (ids) each one token longer: the running seqs' every uncomputed token fits in the free
        blocks. Async scheduling schedules before that step's tokens are known, and a preemption then could
        not be undone."""
        if self.suspects or self._priority_preemption_possible():
            return False
        kv = self.kv
        if kv.fits_without_counting(self.config.max_num_batched_tokens, self._num_running_seqs):
            return True
        left = [(seq.seq_id, len(seq.token_ids) - seq.num_computed_tokens + (seq.seq_id in pending))
                for group in self.running.values() for seq in group.seqs if seq.status is RUNNING]
        return kv.num_new_blocks(left) <= kv.num_free_blocks

    def _priority_preemption_possible(self) -> bool:
        return bool(self.waiting) and bool(self.running) and (
            next(reversed(self.running.values())).priority > self.waiting[0].priority)

    def unschedule(self, out: SchedulerOutput) -> None:
        """``out`` was scheduled ahead and will never run (the step before it failed): its groups still running
        are preempted by recompute, so none counts on the K/V it was to write or swap in."""
        members = {s.group for s in out.scheduled}
        scratch = SchedulerOutput()  # recompute moves no blocks
        for group in [g for g in reversed(self.running.values()) if g in members]:  # last-ranked first
            self._preempt(group, scratch, recompute=True)

    # -- a failed step -------------------------------------------------------
    def recover_failed_step(self, out: SchedulerOutput) -> None:
        """The runner raised on ``out``, so its block moves may not have happened: the groups it
        swapped out are recomputed instead (their CPU copy may be garbage)."""
        for group in out.preempted:
            seqs = group.seqs_with(SWAPPED)
            if not seqs:
                continue
            for seq in seqs:
                self.kv.free(seq.seq_id)
                seq.reset_for_recompute()
            self.swapped.remove(group)
            _insert(self.waiting, group)

    def isolate(self, groups: list[SequenceGroup]) -> None:
        """A batch of these groups failed and any of them may be the cause: each is preempted by
        recompute and becomes a suspect, run alone before normal batching resumes; one whose solo
        step fails too is the caller's to fail."""
        members = set(groups)
        ordered = [g for g in self.running.values() if g in members]  # rank order
        out = SchedulerOutput()  # recompute moves no blocks: nothing for the runner
        for group in reversed(ordered):  # last-ranked first, as victims go
            self._preempt(group, out, recompute=True)
        self.suspects.extend(ordered)

    # -- helpers -------------------------------------------------------------
    def _has_seats(self, group: SequenceGroup) -> bool:
        return self._num_running_seqs + self._num_pending_forks + self._seq_demand(group) <= self.config.max_num_seqs

    def _admission_plan(self, group: SequenceGroup, seqs: list[Sequence], budget: int
                        ) -> tuple[list[Admission], list[ScheduledSeq], int]:
        """Each waiting sequence's prefix-cache hits and share of ``budget``; the budget left."""
        bs = self.config.block_size
        admissions, plan, left = [], [], budget
        for seq in seqs:
            hits = [] if _reads_every_position(group, seq) else self.kv.find_cached_prefix(seq.token_ids,
                                                                                          group.cache_salt)
            start = len(hits) * bs
            num_new = self._chunk(seq.num_tokens - start, left)
            if self.encoder_budget is not None:  # images: the chunk's encoder runs fit the encoder budget
                num_new = self.encoder_budget.clip(group, start, num_new)
            admissions.append(Admission(hits, start + num_new, self._size(group, seq)))
            if num_new:
                plan.append(ScheduledSeq(group=group, seq=seq, start=start, num_new_tokens=num_new,
                                         do_sample=start + num_new == seq.num_tokens and group.pooling is None))
            left -= num_new
        return admissions, plan, left

    def _admissible(self, seqs: list[Sequence], admissions: list[Admission], plan: list[ScheduledSeq]) -> bool:
        # The first sequence must make progress.
        return bool(plan) and plan[0].seq is seqs[0] and self.kv.can_admit(admissions)

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens of a ``remaining``-token prefill that fit this step (0: none)."""
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _plan(self, group: SequenceGroup, seqs: list[Sequence], budget: int,
              drafts: Mapping[int, list[int]] = {}) -> tuple[list[ScheduledSeq], int]:
        """The leading ``seqs``' shares of ``budget`` (block tables come with ``_commit``), and their sum."""
        plan = []
        total = 0
        for seq in seqs:
            start = seq.num_computed_tokens
            remaining = len(seq.token_ids) - start
            if not remaining:
                continue  # a beam candidate waiting for its siblings' distributions
            num_new = remaining if remaining <= budget - total else self._chunk(remaining, budget - total)
            if self.encoder_budget is not None:  # images: the chunk's encoder runs fit the encoder budget
                num_new = self.encoder_budget.clip(group, start, num_new)
            if num_new <= 0:
                break
            s = ScheduledSeq(group=group, seq=seq, start=start, num_new_tokens=num_new,
                             do_sample=start + num_new == len(seq.token_ids) and group.pooling is None)
            if drafts and (proposed := drafts.get(seq.seq_id)):
                _attach_drafts(s, proposed, budget - total - num_new)
            plan.append(s)
            total += s.num_new_tokens
        return plan, total

    def _make_room(self, group: SequenceGroup, need: int, out: SchedulerOutput) -> bool:
        """Preempt last-ranked groups until ``need`` blocks are free; False if ``group`` itself went."""
        while need > self.kv.num_free_blocks:
            victim = next(reversed(self.running.values()))
            self._preempt(victim, out)
            if victim is group:
                return False
        return True

    def _commit(self, group: SequenceGroup, plan: list[ScheduledSeq], out: SchedulerOutput) -> None:
        kv = self.kv
        for s in plan:
            seq_id = s.seq.seq_id
            if s.draft_token_ids:
                out.num_draft_tokens += len(s.draft_token_ids)
            copy = kv.append(seq_id, s.num_new_tokens)
            if copy is not None:
                out.blocks_to_copy.append(copy)
            s.block_table = kv.block_ids(seq_id)
            if self._hybrid:
                s.state = kv.state.step(seq_id, s.start, s.num_new_tokens, len(s.seq.token_ids))
        out.scheduled += plan
        # n > 1: fork once the (one) prompt is in. No group has forks pending in a steady decode.
        if (self._num_pending_forks and not group.params.use_beam_search and len(group.seqs) < group.params.n
                and plan[-1].do_sample):
            parent = plan[-1]
            parent.forks = tuple(parent.seq.fork(index) for index in range(len(group.seqs), group.params.n))

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput, recompute: bool = False) -> None:
        del self.running[group.request_id]
        seqs = group.seqs_with(RUNNING)
        self._num_running_seqs -= len(seqs)
        self._num_pending_forks -= _pending_forks(group)
        seq_ids = [s.seq_id for s in seqs]
        swap = not recompute and self.config.preemption_mode == "swap"
        if swap and self.kv.can_swap_out(seq_ids):
            mapping = self.kv.swap_out(seq_ids)
            out.blocks_to_swap_out.extend(mapping)
            self.num_swapped_out_blocks += len(mapping)
            for seq in seqs:
                seq.status = SWAPPED
            _insert(self.swapped, group)
        else:
            for seq in seqs:
                self.kv.free(seq.seq_id)
                seq.reset_for_recompute()
            if group.params.use_beam_search:
                self.beams.recomputing(group.request_id)
            _insert(self.waiting, group)  # ahead of every later arrival of its priority
        group.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(group)

    def _admit(self, group: SequenceGroup, seqs: list[Sequence], admissions: list[Admission]) -> None:
        # Take every hit first so allocating one sequence's new blocks cannot evict another's hit.
        for seq, a in zip(seqs, admissions):
            self.kv.admit(seq.seq_id, a.hits, group.cache_salt, seq.num_tokens, a.size)
            seq.num_computed_tokens = len(a.hits) * self.config.block_size
        if group.metrics.num_preemptions == 0:  # a resumed request's hits may cover output tokens: not counted
            group.num_cached_tokens = min(seqs[0].num_computed_tokens, seqs[0].num_prompt_tokens)
        self._set_running(group, seqs)

    def _set_running(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.status = RUNNING
        last = next(reversed(self.running.values()), None)
        self.running[group.request_id] = group
        if last is not None and group.rank < last.rank:  # it outranks a running group: keep rank order
            self.running = dict(sorted(self.running.items(), key=lambda item: item[1].rank))
        self._num_running_seqs += len(seqs)
        self._num_pending_forks += _pending_forks(group)

    def _seq_demand(self, group: SequenceGroup) -> int:
        """Seats a waiting group needs: its unfinished sequences and those it will fork."""
        return len(group.unfinished_seqs()) + _pending_forks(group)

    def _admission_error(self, group: SequenceGroup) -> str | None:
        cfg = self.config
        seqs = group.unfinished_seqs()
        longest = max(s.num_tokens for s in seqs)
        if not cfg.enable_chunked_prefill and longest > cfg.max_num_batched_tokens:
            return (f"prompt of {longest} tokens exceeds max_num_batched_tokens={cfg.max_num_batched_tokens} "
                    "and chunked prefill is disabled")
        error = self.kv.admission_error([self._size(group, s) for s in seqs])
        if error is not None:
            return error
        if self._seq_demand(group) > cfg.max_num_seqs:
            return f"n={self._seq_demand(group)} exceeds max_num_seqs={cfg.max_num_seqs}"
        return None

    def _size(self, group: SequenceGroup, seq: Sequence) -> SeqSize:
        max_tokens, limit = group.params.max_tokens, self.config.max_model_len
        max_len = limit if max_tokens is None else seq.num_prompt_tokens + max_tokens
        if max_len is not None and limit is not None:
            max_len = min(max_len, limit)
        return SeqSize(seq.num_tokens, seq.num_prompt_tokens, max_len)

    def _fail(self, group: SequenceGroup, error: str, out: SchedulerOutput) -> None:
        self._end(group, SequenceStatus.FINISHED_ERROR, error)
        out.failed.append(group)

    # -- introspection -------------------------------------------------------
    def has_unfinished(self) -> bool:
        """Whether a request is registered: unfinished, or finished and not reported yet."""
        return bool(self.requests) or bool(self._unreported)

    def stats(self) -> EngineStats:
        """The scheduler's and its KV allocator's figures."""
        kv = self.kv.stats()
        return EngineStats(
            num_requests_running=len(self.running), num_requests_waiting=len(self.waiting),
            num_requests_swapped=len(self.swapped), kv_cache_usage=kv.usage, kv_token_utilization=kv.token_utilization,
            num_blocks_total=kv.num_blocks, num_blocks_free=kv.num_free_blocks,
            num_blocks_cached=kv.num_cached_free_blocks, num_blocks_used=kv.num_used_blocks,
            num_cpu_blocks_total=kv.num_cpu_blocks, num_cpu_blocks_used=kv.num_cpu_used_blocks,
            kv_tokens_stored=kv.num_tokens_stored, kv_reserved_slots=kv.num_reserved_slots,
            kv_internal_frag_slots=kv.num_internal_frag_slots, kv_external_frag_slots=kv.num_external_frag_slots,
            kv_free_slots=kv.num_free_slots, num_preemptions_total=self.num_preemptions,
            prefix_cache_queries_total=self.kv.prefix_cache_queries, prefix_cache_hits_total=self.kv.prefix_cache_hits,
            prompt_tokens_total=self.num_prompt_tokens, generation_tokens_total=self.num_generated_tokens,
            num_swapped_out_blocks_total=self.num_swapped_out_blocks,
            num_swapped_in_blocks_total=self.num_swapped_in_blocks,
            num_window_released_blocks_total=kv.num_window_released_blocks,
            **self._spec_stats(), **self._state_stats())

    def _state_stats(self) -> dict[str, int]:
        if not self._hybrid:
            return {}
        state = self.kv.state.stats()
        return dict(num_state_slots_total=state.num_slots, num_state_slots_used=state.num_used_slots,
                    num_state_snapshots_total=state.num_snapshots, num_state_snapshots_used=state.num_used_snapshots,
                    state_snapshot_hits_total=state.snapshot_hits)

    def _spec_stats(self) -> dict[str, float]:
        spec = self.speculation
        drafts, tokens, accepted = spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens
        return dict(spec_decode_num_drafts_total=drafts, spec_decode_num_draft_tokens_total=tokens,
                    spec_decode_num_accepted_tokens_total=accepted,
                    spec_decode_acceptance_rate=accepted / max(tokens, 1),
                    spec_decode_mean_accepted_length=1 + accepted / drafts if drafts else 0.0)

    def kv_snapshot(self, stats: EngineStats) -> KVSnapshot:
        """The KV pools block by block, the requests holding blocks (running, swapped) and the first
        waiting ones, with ``stats`` taken at the same moment (between steps)."""
        listed = ([(g, "running") for g in self.running.values()] + [(g, "swapped") for g in self.swapped]
                  + [(g, "waiting") for g in islice(self.waiting, MAX_WAITING_LISTED)])[:NO_OWNER]
        seq_ids = [[s.seq_id for s in g.unfinished_seqs()] for g, _ in listed]
        pools = self.kv.snapshot(seq_ids)
        bs = self.kv.block_size
        requests = [SnapshotRequest(g.request_id, state, len(ids), blocks,
                                    image_block_ids=image_block_ids(g.cache_salt.spans, blocks, bs)  # images
                                    if isinstance(g.cache_salt, ImageBlockKeys) else [])
                    for (g, state), ids, blocks in zip(listed, seq_ids, pools.blocks)]
        return KVSnapshot(time=time.time(), block_size=self.kv.block_size, device=pools.device, cpu=pools.cpu,
                          requests=requests, stats=stats)


def _reads_every_position(group: SequenceGroup, seq: Sequence) -> bool:
    """Prompt logprobs need every prompt position's logits (vLLM's rule too), and mean or CLS pooling their
    hidden states: no prefix-cache hits for them."""
    return wants_prompt_logprobs(group, seq) or (group.pooling is not None and group.pooling.needs_every_position)


def _insert(queue: deque[SequenceGroup], group: SequenceGroup) -> None:
    """Into ``queue`` at its rank (after any equal rank; ranks are unique)."""
    queue.insert(bisect.bisect_right(queue, group.rank, key=lambda g: g.rank), group)
