"""Beam search on the shared block tree (the paper's §4.4; docs/architecture.md §3.9).

A beam request is one ``SequenceGroup`` whose live sequences are its candidates
(at most ``beam_width``). Once every candidate has a next-token log-prob row,
``select`` takes the best (candidate, token) pairs of the whole request by
cumulative log-probability, with transformers' ``num_beams`` rule: the top
``max(2, 1 + #eos) * width`` pairs, of which those ending in eos (or reaching
the length limit) become finished hypotheses when they rank in the top
``width``, and the first ``width`` others run on. ``advance`` then rebuilds the
candidates on the KV manager: a parent chosen once appends in place, a parent
chosen again is forked (its blocks' ref counts +1; the shared partial block is
copied on write at the next append), a parent not chosen is dropped (its blocks
are freed by the caller, at once). Scores stay fp32 as in transformers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.kv_allocator import KVAllocator
from engine.core.scheduler_output import ScheduledSeq
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus

_GREEDY_TEMPERATURE = 1e-5  # at or below it the raw distribution is scored (SamplingParams.greedy)


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its generated tokens (eos included), fp32 scores."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (eos) or "length"


@dataclass(slots=True)
class Continuation:
    parent: int  # index of the candidate it extends
    token: int
    cumulative_logprob: float


@dataclass(slots=True)
class BeamState:
    """One request's search: settings, finished hypotheses (best first), and the
    log-prob rows of candidates waiting for their siblings (a chunked re-prefill)."""

    width: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int  # transformers' max_length - prompt length
    eos: frozenset[int]
    hyps: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True  # transformers' early-stop heuristic: can a running beam still beat the worst hypothesis
    done: bool = False
    pending: dict[int, TopTokens] = field(default_factory=dict)  # seq_id -> its row's best tokens

    @classmethod
    def for_request(cls, params: SamplingParams, num_prompt_tokens: int, eos_token_ids: frozenset[int],
                    max_model_len: int | None) -> BeamState:
        caps = [c for c in (params.max_tokens, max_model_len and max_model_len - num_prompt_tokens) if c]
        if not caps:
            raise ValueError("beam search needs max_tokens or max_model_len")
        return cls(params.beam_width, params.length_penalty, params.early_stopping, min(caps),
                   _eos(params, eos_token_ids))

    @property
    def full(self) -> bool:
        return len(self.hyps) == self.width


def _eos(params: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)


def num_kept(params: SamplingParams, eos_token_ids: frozenset[int]) -> int:
    """(candidate, token) pairs a step of the request keeps."""
    return _num_kept(params.beam_width, _eos(params, eos_token_ids))


def _num_kept(width: int, eos: frozenset[int]) -> int:
    """transformers' max(2, 1 + #eos) * width."""
    return max(2, 1 + len(eos)) * width


@dataclass(slots=True)
class TopTokens:
    """Best next tokens of logits rows, by falling log-probability (on the CPU): the top pairs of a
    whole request are among its candidates' own top pairs, so no step needs a full row again."""

    logprobs: torch.Tensor  # [rows, k] fp32
    token_ids: torch.Tensor  # [rows, k]

    @classmethod
    def of(cls, logprobs: torch.Tensor, k: int) -> TopTokens:
        values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        return cls(values.cpu(), ids.cpu())

    def row(self, i: int) -> TopTokens:
        return TopTokens(self.logprobs[i], self.token_ids[i])


def top_tokens(logits: torch.Tensor, samples: list[tuple[int, ScheduledSeq]], eos_token_ids: frozenset[int]
               ) -> TopTokens:
    """The best next tokens of the beam candidates' logits rows (``(row, ScheduledSeq)`` pairs): fp32
    log-softmax (of the logits divided by the request's temperature when it is above greedy), as many
    per row as its request keeps per step."""
    rows = logits[[row for row, _ in samples]].float()
    temps = [s.group.params.temperature for _, s in samples]
    if any(t > _GREEDY_TEMPERATURE for t in temps):
        scale = torch.tensor([t if t > _GREEDY_TEMPERATURE else 1.0 for t in temps], device=rows.device)
        rows = rows / scale[:, None]
    k = max(num_kept(s.group.params, eos_token_ids) for _, s in samples)
    return TopTokens.of(torch.log_softmax(rows, dim=-1), k)


def select(state: BeamState, cands: list[Sequence], top_rows: list[TopTokens]) -> list[Continuation]:
    """One beam step over the candidates' best next tokens: records the finished hypotheses in
    ``state`` and returns the candidates to run next, best first (none once done)."""
    width = state.width
    logprobs = torch.stack([r.logprobs for r in top_rows])
    columns = logprobs.shape[1]
    cum = torch.tensor([c.cumulative_logprob for c in cands], dtype=torch.float32)
    scores = (logprobs + cum[:, None]).view(-1)  # fp32 sums, as transformers adds them
    top, flat = scores.topk(min(_num_kept(width, state.eos), scores.numel()))
    length = cands[0].num_output_tokens + 1  # every candidate has as many tokens
    normalized = (top / length ** state.length_penalty).tolist()
    at_limit = length >= state.max_new_tokens
    running, finished = [], []
    for rank, (value, index, norm) in enumerate(zip(top.tolist(), flat.tolist(), normalized)):
        parent, column = divmod(index, columns)
        token = int(top_rows[parent].token_ids[column])
        if at_limit or token in state.eos:
            if rank < width:  # only the top width pairs may finish (the rest are spares for running)
                tokens = cands[parent].output_token_ids + [token]
                finished.append(Hypothesis(tokens, value, norm, "stop" if token in state.eos else "length"))
        elif len(running) < width:
            running.append(Continuation(parent, token, value))
    _add_hypotheses(state, finished)
    _update_done(state, running, length)
    return [] if state.done else running


def _add_hypotheses(state: BeamState, finished: list[Hypothesis]) -> None:
    # transformers accepts none once the set is full under early_stopping=True or no beam can improve it.
    if not finished or not state.improvable or (state.full and state.early_stopping is True):
        return
    state.hyps = sorted(state.hyps + finished, key=lambda h: -h.score)[:state.width]


def _update_done(state: BeamState, running: list[Continuation], length: int) -> None:
    """transformers' stop rule: nothing left to run (the length limit), or the early-stop heuristic."""
    if running and state.full and state.improvable:
        lp = state.length_penalty
        best_length = state.max_new_tokens if state.early_stopping == "never" and lp > 0 else length
        best = torch.tensor(running[0].cumulative_logprob, dtype=torch.float32) / best_length ** lp
        state.improvable = best.item() > min(h.score for h in state.hyps)
    state.done = not running or not state.improvable or (state.full and state.early_stopping is True)


def advance(kv: KVAllocator, cands: list[Sequence],
            running: list[Continuation]) -> tuple[list[Sequence], list[Sequence]]:
    """The next candidates (``running``'s order) and the dropped ones, whose blocks (and a hybrid model's state
    slots) are freed here before the forks take theirs. Call between steps, once the candidates' K/V is computed
    (forks share it)."""
    chosen = {c.parent for c in running}
    dropped = [s for i, s in enumerate(cands) if i not in chosen]
    for seq in dropped:
        kv.free(seq.seq_id)
    kept: set[int] = set()
    nxt = []
    for rank, c in enumerate(running):
        parent = cands[c.parent]
        if c.parent in kept:  # chosen again: a child shares the parent's blocks
            child = parent.fork(rank)
            kv.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens, child.status = parent.num_computed_tokens, SequenceStatus.RUNNING
        else:
            kept.add(c.parent)
            child, child.index = parent, rank
        nxt.append(child)
    for seq, c in zip(nxt, running):  # after every fork: a child copies its parent's tokens
        seq.append_token(c.token)
        seq.cumulative_logprob = c.cumulative_logprob
    return nxt, dropped


def final_sequences(state: BeamState, prompt: list[int], n: int) -> list[Sequence]:
    """The ``n`` best hypotheses as finished sequences, choice index = rank."""
    status = {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH}
    return [Sequence(prompt + h.token_ids, len(prompt), rank, status[h.finish_reason],
                     cumulative_logprob=h.cumulative_logprob)
            for rank, h in enumerate(state.hyps[:n])]


@dataclass(slots=True)
class BeamStep:
    """What one step of a search did: the candidates to run next and those dropped (their blocks to free), or,
    once it is over, its best hypotheses as finished sequences (``final``)."""

    cands: list[Sequence]
    dropped: list[Sequence]
    final: list[Sequence] | None = None


class BeamSearches:
    """Every live beam request's ``BeamState``, by request id; the scheduler calls it with each step's rows."""

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int | None) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._states: dict[str, BeamState] = {}

    def start(self, request_id: str, params: SamplingParams, num_prompt_tokens: int) -> None:
        self._states[request_id] = BeamState.for_request(params, num_prompt_tokens, self.eos_token_ids,
                                                         self.max_model_len)

    def record(self, samples: list[tuple[int, ScheduledSeq]], tokens: TopTokens) -> list[ScheduledSeq]:
        """Keep each running candidate's best tokens; returns a scheduled seq of each search whose candidates
        all have theirs (its step is due), once per search."""
        if len(samples) != len(tokens.logprobs):
            raise ValueError(f"{len(samples)} beam candidates sampled, {len(tokens.logprobs)} rows of tokens")
        touched: dict[str, ScheduledSeq] = {}
        for i, (_, s) in enumerate(samples):
            if s.seq.status is SequenceStatus.RUNNING:
                self._states[s.group.request_id].pending[s.seq.seq_id] = tokens.row(i)
                touched.setdefault(s.group.request_id, s)
        return [s for rid, s in touched.items()
                if all(seq.seq_id in self._states[rid].pending for seq in s.group.seqs)]

    def step(self, kv: KVAllocator, request_id: str, cands: list[Sequence], prompt: list[int], n: int) -> BeamStep:
        """The search's step over its candidates' recorded rows; the state is dropped once it is over."""
        state = self._states[request_id]
        running = select(state, cands, [state.pending.pop(seq.seq_id) for seq in cands])
        if state.done:
            del self._states[request_id]
            return BeamStep([], cands, final_sequences(state, prompt, n))
        nxt, dropped = advance(kv, cands, running)
        return BeamStep(nxt, dropped)

    def recomputing(self, request_id: str) -> None:
        """Its candidates' K/V is dropped: their rows come again with the recomputed K/V."""
        self._states[request_id].pending.clear()

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
