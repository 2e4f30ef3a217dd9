"""The step-driven engine: requests in, incremental token outputs out.

Each ``step``: the scheduler picks the batch, the runner computes its logits,
the sampler draws the tokens, and ``Scheduler.update_from_output`` records
them (forks, stops, frees); the engine turns the groups that got tokens into
incremental ``RequestOutput``s."""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future

import torch

from engine import beam_search
from engine.async_step import StepPipeline, runs_ahead
from engine.config import EngineConfig
from engine.core.kv_snapshot import KVSnapshot
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput, wants_prompt_logprobs
from engine.distributed.executor import create_executor
from engine.model_runner import Logits, PromptLogprobs
from engine.outputs import CompletionOutput, RequestOutput, ResumeState, TokenLogprobs
from engine.sampler import Sampler, SamplerOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.spec_decode.speculator import Speculator, make_speculator
from engine.stats import EngineStats
from engine.structured_output import StructuredOutputManager, TokenMask, check_structured_output

# The longest structured_output spec (schema / regex / grammar text) the engine compiles.
MAX_STRUCTURED_OUTPUT_CHARS = 1 << 20

logger = logging.getLogger(__name__)

# has_capacity() keeps this share of the pool free for the running seqs to grow into.
_FREE_BLOCK_WATERMARK = 0.05


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config, self.runner = create_executor(config)  # a ModelRunner, or rank 0 of a tensor-parallel group
        self.max_model_len = self.config.scheduler.max_model_len
        self.eos_token_ids: set[int] = set(self.config.model_config.eos_token_ids)
        self.scheduler = Scheduler(self.config.scheduler, self.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, config.seed, self.config.device, self.runner.ops)
        self._groups: dict[str, SequenceGroup] = {}
        self._aborted: list[SequenceGroup] = []
        # Resumed requests with choices finished on arrival (their stop condition already met): reported next step.
        self._resumed_ends: dict[str, tuple[SequenceGroup, list[Sequence]]] = {}
        # The prompt logprobs of requests that asked, filled in as their prefill chunks run (entry 0 is None).
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        self.grammar = StructuredOutputManager(self._tokenizer_info, config.max_grammar_bytes)
        # Requests whose grammar compiles on the manager's pool, in arrival order; then their compiled grammar.
        self._pending: deque[tuple[SequenceGroup, ResumeState | None, Future]] = deque()
        self._grammars: dict[str, object] = {}
        self._pipeline = StepPipeline(self.runner) if config.async_scheduling else None
        self.speculator: Speculator | None = make_speculator(config, self.config)
        self._propose_seconds = self._verify_seconds = 0.0
        self._scheduled_at = 0.0  # when the latest step was scheduled (the verification time of its step)

    # ---- requests -------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    resume: ResumeState | None = None, priority: int = 0) -> None:
        """Queue a request. ``resume``: the request ran elsewhere and its engine died; it continues
        from the tokens already delivered (recomputed as context) exactly as an undisturbed run would,
        and ``step`` returns only the new tokens. See ``ResumeState`` for what is not carried over.
        ``priority``: lower is scheduled first and preempted last (vLLM's convention); equal ones go by arrival.
        ``params.prompt_logprobs`` come with the first output; a resumed request that had delivered tokens
        already had them, so they are not computed again (one that had delivered none gets them)."""
        self._validate(request_id, prompt_token_ids, params)
        if resume is not None:
            self._validate_resume(prompt_token_ids, params, resume)
        group = SequenceGroup(request_id, _new_seqs(list(prompt_token_ids), resume), params,
                              time.time() if arrival_time is None else arrival_time,
                              cache_salt=cache_salt.encode() if cache_salt else None, priority=priority)
        self.scheduler.check_new(group)
        self._groups[request_id] = group
        if params.structured_output is not None:  # scheduled once its grammar is compiled (_admit_pending)
            self._pending.append((group, resume, self.grammar.compile(params.structured_output)))
        else:
            self._schedule_new(group, resume)

    def _schedule_new(self, group: SequenceGroup, resume: ResumeState | None) -> None:
        request_id = group.request_id
        self.scheduler.add_group(group)
        if wants_prompt_logprobs(group, group.seqs[0]):
            self._prompt_logprobs[request_id] = [None]
        if resume is not None:
            ended = [seq for seq in group.seqs if seq.is_finished and resume.finish_reasons[seq.index] is None]
            if ended or group.is_finished:
                self._resumed_ends[request_id] = (group, ended)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not prompt:
            raise ValueError("the prompt is empty (it needs at least one token)")
        self._check_token_ids("prompt", prompt)
        if params.logit_bias:
            self._check_token_ids("logit_bias", list(params.logit_bias))
        if params.structured_output is not None:
            check_structured_output(params.structured_output, MAX_STRUCTURED_OUTPUT_CHARS)
        wanted = len(prompt) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise ValueError(f"this model's maximum context length (max_model_len) is {self.max_model_len} tokens; "
                             f"the prompt has {len(prompt)} tokens and {params.max_tokens or 1} more were requested "
                             f"(max_tokens), {wanted} in total")

    def _validate_resume(self, prompt: list[int], params: SamplingParams, resume: ResumeState) -> None:
        if not isinstance(resume, ResumeState):
            raise ValueError(f"resume must be a ResumeState, got {type(resume).__name__}")
        if params.use_beam_search:
            raise ValueError("a beam search cannot be resumed (it publishes only once it is over): "
                             "run it again from the start")
        resume.check(params.n)
        self._check_token_ids("resumed output", [t for out in resume.output_token_ids for t in out])
        longest = max(len(out) for out in resume.output_token_ids)
        if params.max_tokens is not None and longest > params.max_tokens:
            raise ValueError(f"a resumed choice has {longest} output tokens, more than max_tokens={params.max_tokens}")
        # At the limit a choice finishes ("length") on arrival: nothing more is needed.
        if len(prompt) + longest > self.max_model_len:
            raise ValueError(f"the prompt ({len(prompt)} tokens) and a resumed choice ({longest} tokens) exceed "
                             f"this model's maximum context length (max_model_len) of {self.max_model_len} tokens")

    def _check_token_ids(self, what: str, ids: list[int]) -> None:
        vocab_size = self.config.model_config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            raise ValueError(f"{what} token ids must be in [0, {vocab_size}), got range [{min(ids)}, {max(ids)}]")

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        known = [i for i in ids if i in self._groups]
        if known:
            # A resumed request that finished on arrival is not the scheduler's: it still reports its own finish.
            aborted = self.scheduler.abort(known)
            self._aborted += aborted
            for group in aborted:
                self._resumed_ends.pop(group.request_id, None)
            for request_id in known:
                self._forget_grammar(self._groups.pop(request_id))

    def _forget_grammar(self, group: SequenceGroup) -> None:
        """An aborted request's grammar state; one still compiling is aborted here (the scheduler never saw it)."""
        if any(g is group for g, _, _ in self._pending):
            for seq in group.seqs:
                seq.status = SequenceStatus.FINISHED_ABORTED
            self._aborted.append(group)
        if self._grammars.pop(group.request_id, None) is not None:
            for seq in group.seqs:
                self.grammar.release(seq.seq_id)

    def _admit_pending(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is ready, in arrival order; fail those whose grammar failed."""
        outputs = []
        while self._pending and self._pending[0][2].done():
            group, resume, future = self._pending.popleft()
            if group.request_id not in self._groups:  # aborted while compiling
                continue
            if future.exception() is not None:
                for seq in group.seqs:
                    seq.status = SequenceStatus.FINISHED_ERROR
                outputs.append(self._final_output(group, SequenceStatus.FINISHED_ERROR,
                                                  f"structured_output: {future.exception()}"))
                continue
            self._grammars[group.request_id] = future.result()
            self._schedule_new(group, resume)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._aborted) or bool(self._resumed_ends)

    def has_capacity(self) -> bool:
        s = self.scheduler
        kv = s.kv  # its num_free_blocks / num_blocks directly: stats() also computes fields unused here
        return (not s.waiting and len(s.running) + len(s.swapped) < s.config.max_num_seqs
                and kv.num_free_blocks > _FREE_BLOCK_WATERMARK * kv.num_blocks)

    # ---- one iteration --------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = [self._final_output(g, SequenceStatus.FINISHED_ABORTED) for g in self._aborted]
        self._aborted.clear()
        if self._pending:
            outputs += self._admit_pending()
        outputs += self._resumed_end_outputs()
        if self._pipeline is not None:
            return outputs + self._step_async()
        out = self._schedule(outputs)
        if out.is_empty:
            return outputs
        try:
            logits = self.runner.execute(out)
            return outputs + self._process_samples(out, logits, self._sample(out.samples(), logits))
        except Exception as exc:  # a failing batch never fails the engine
            return outputs + self._recover(out, exc)

    def _schedule(self, outputs: list[RequestOutput]) -> SchedulerOutput:
        """The next step (with proposed tokens to verify when speculating); the groups the scheduler failed go
        to ``outputs``."""
        if self.speculator is None:
            out = self.scheduler.schedule()
        else:
            started = time.perf_counter()
            self.speculator.propose(self.scheduler.running.values())
            self._propose_seconds += time.perf_counter() - started
            out = self.scheduler.schedule()
            self.speculator.discard_unscheduled()
            self._scheduled_at = time.perf_counter()
        self._report_failed(out, outputs)
        return out

    def _report_failed(self, out: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        for group in out.failed:
            outputs.append(self._final_output(group, SequenceStatus.FINISHED_ERROR, group.error))

    def _step_async(self) -> list[RequestOutput]:
        """One step's outputs, the next step scheduled (when ``runs_ahead``) and launched before they are
        processed (engine/async_step.py)."""
        pipeline, outputs = self._pipeline, []
        if pipeline.in_flight is None:
            out = self._schedule(outputs)
            if out.is_empty:
                return outputs
            try:
                pipeline.launch(out, self.runner.plan(out))
            except Exception as exc:
                return outputs + self._recover(out, exc)
        current = pipeline.take()
        out, ahead = current.out, None
        if runs_ahead(out, bool(self._grammars), self.speculator is not None and self._speculates(out)):
            ahead = pipeline.schedule_ahead(self.scheduler, out)
            if ahead is not None:
                self._report_failed(ahead.out, outputs)
        try:
            logits = current.logits.result()
            samples = out.samples()
            tokens, values = self._draw(samples, logits)
        except Exception as exc:
            outputs += self._recover(out, exc)
            if ahead is not None:
                self.scheduler.unschedule(ahead.out)
            return outputs
        if ahead is not None and not ahead.out.is_empty:
            tokens = pipeline.launch_ahead(ahead, tokens)
        sampled = self._output(samples, tokens, values)
        return outputs + self._process_samples(out, logits, sampled)

    def _speculates(self, out: SchedulerOutput) -> bool:
        """Whether a request of ``out`` speculates: its next proposals read this step's tokens."""
        return any(self.speculator.eligible(s.group) for s in out.scheduled)

    def _recover(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """A batch of several requests is retried one request at a time (``Scheduler.isolate``): one
        bad request never fails its batch-mates. A request that failed alone is failed."""
        self.scheduler.recover_failed_step(out)
        groups = list({id(s.group): s.group for s in out.scheduled}.values())
        if len(groups) > 1:
            logger.warning("step failed (%s: %s); retrying its %d requests one at a time",
                           type(exc).__name__, exc, len(groups))
            self.scheduler.isolate(groups)
            return []
        logger.exception("step failed; failing its request")
        return self._fail_scheduled(out, f"internal error while running the batch: {exc}")

    def _process_samples(self, out: SchedulerOutput, logits: Logits | None, sampled: SamplerOutput
                         ) -> list[RequestOutput]:
        now = time.time()
        for s in out.scheduled:
            s.group.metrics.first_scheduled_time = s.group.metrics.first_scheduled_time or now
        if logits is not None and logits.prompt is not None:
            self._record_prompt_logprobs(out, logits.prompt)  # first: the positions are read off the seqs' tokens
        samples, beams = out.samples(), out.beam_samples()
        beam_tokens = beam_search.top_tokens(logits.values, beams) if beams else None
        groups = self.scheduler.update_from_output(out, sampled, beam_tokens)
        if self._grammars:
            self._advance_grammars(samples)
        if self.speculator is not None:
            self.speculator.observe(out)
            if out.num_draft_tokens:
                self._verify_seconds += time.perf_counter() - self._scheduled_at
        return [self._step_output(g, now) for g in groups]

    def _record_prompt_logprobs(self, out: SchedulerOutput, prompt: PromptLogprobs) -> None:
        """Append the step's prompt rows to their requests' prompt logprobs. A re-prefill (recompute
        preemption before the first token) starts over: what it recomputes replaces the earlier entries."""
        token, top_ids, top_logprobs = prompt.token.tolist(), prompt.top_ids.tolist(), prompt.top_logprobs.tolist()
        row = 0
        for s in out.scheduled:
            span = s.prompt_logprob_positions()
            entries = self._prompt_logprobs.get(s.group.request_id) if span else None
            if entries is not None:
                k = s.group.params.prompt_logprobs
                del entries[span.start + 1:]
                entries += [[(target, token[r]), *zip(top_ids[r][:k], top_logprobs[r][:k])]
                            for r, target in enumerate(s.seq.token_ids[span.start + 1:span.stop + 1], row)]
            row += len(span)

    def _sample(self, samples: list[tuple[int, ScheduledSeq, Sequence]], logits: Logits | None) -> SamplerOutput:
        return self._output(samples, *self._draw(samples, logits))

    def _output(self, samples: list[tuple[int, ScheduledSeq, Sequence]], tokens: torch.Tensor | None,
                values: torch.Tensor | None) -> SamplerOutput:
        """``_draw``'s tokens (and logprobs) on the host."""
        if not samples:
            return SamplerOutput([], [])
        return self.sampler.output(values, tokens, [s.group.params for _, s, _ in samples])

    def _draw(self, samples: list[tuple[int, ScheduledSeq, Sequence]], logits: Logits | None
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The samples' tokens, still on the device, and their rows' raw logits (None: argmax only)."""
        if not samples:
            return None, None
        if len(samples) != len(logits):  # forks draw several tokens from one row
            logits = logits.select([row for row, _, _ in samples])
        seqs = [seq for _, _, seq in samples]
        mask = self._constrain(samples) if self._grammars else None
        params = [s.group.params for _, s, _ in samples]
        return self.sampler.draw(logits.values, seqs, params, logits.argmax, mask), logits.values

    # ---- structured output ------------------------------------------------
    def _tokenizer_info(self):
        import transformers
        import xgrammar

        tokenizer = transformers.AutoTokenizer.from_pretrained(self.config.tokenizer)
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.config.model_config.vocab_size,
                                                       stop_token_ids=sorted(self.eos_token_ids) or None)

    def _constrain(self, samples: list[tuple[int, ScheduledSeq, Sequence]]) -> TokenMask | None:
        """The mask of the constrained rows, synced to their sequences' tokens (a matcher whose count
        differs, after preemption, a failed step, resume or a fork, is rebuilt from the tokens). A row whose
        grammar allows nothing draws a placeholder (token 0), and ``_advance_grammars`` fails its choice."""
        rows, matchers = [], []
        for i, (_, s, seq) in enumerate(samples):
            compiled = self._grammars.get(s.group.request_id)
            if compiled is not None:
                m = self.grammar.matcher(seq.seq_id, compiled)
                if m.sync(seq.output_token_ids):
                    rows.append(i)
                    matchers.append(m)
        if not rows:
            return None
        mask, dead = self.grammar.fill_mask(rows, matchers, self.config.model_config.vocab_size)
        for i in dead:
            matchers[rows.index(i)].consumed = -1
        return mask

    def _advance_grammars(self, samples: list[tuple[int, ScheduledSeq, Sequence]]) -> None:
        """Feed each constrained choice its new token: a completed grammar stops it, a token the
        grammar refuses (no token was allowed) ends it with an error."""
        for _, s, seq in samples:
            compiled = self._grammars.get(s.group.request_id)
            if compiled is None:
                continue
            m = self.grammar.matcher(seq.seq_id, compiled)
            if not seq.is_finished:
                if m.consumed < 0 or not m.sync(seq.output_token_ids):
                    self.scheduler.finish_seq(s.group, seq, SequenceStatus.FINISHED_ERROR)
                elif m.terminated:
                    self.scheduler.finish_seq(s.group, seq, SequenceStatus.FINISHED_STOPPED)
            if seq.is_finished:
                self.grammar.release(seq.seq_id)
            if s.group.is_finished:
                self._grammars.pop(s.group.request_id, None)

    def _fail_scheduled(self, out: SchedulerOutput, message: str) -> list[RequestOutput]:
        groups = {s.group.request_id: s.group for s in out.scheduled}
        failed = self.scheduler.abort(list(groups))
        for group in failed:
            for seq in group.seqs:
                if seq.status is SequenceStatus.FINISHED_ABORTED:
                    seq.status = SequenceStatus.FINISHED_ERROR
        return [self._final_output(g, SequenceStatus.FINISHED_ERROR, message) for g in failed]

    # ---- outputs --------------------------------------------------------
    def _step_output(self, group: SequenceGroup, now: float) -> RequestOutput:
        m = group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        completions = [self._delta(group, seq) for seq in group.seqs
                       if len(seq.token_ids) - seq.num_prompt_tokens > seq.num_emitted_tokens]
        return self._request_output(group, completions, None)

    def _resumed_end_outputs(self) -> list[RequestOutput]:
        """The finish reasons (no tokens) of resumed choices that had already ended."""
        outputs = [self._request_output(group, [self._delta(group, seq) for seq in ended], None)
                   for group, ended in self._resumed_ends.values()]
        self._resumed_ends.clear()
        return outputs

    def _final_output(self, group: SequenceGroup, status: SequenceStatus, error: str | None = None) -> RequestOutput:
        self._groups.pop(group.request_id, None)
        completions = [self._delta(group, seq) for seq in group.seqs if seq.status is status]
        return self._request_output(group, completions, error)

    def _request_output(self, group: SequenceGroup, completions: list[CompletionOutput], error: str | None) -> RequestOutput:
        # Positional arguments and no per-seq property calls: this runs for every group every step.
        finished = group.is_finished
        if finished:
            group.metrics.finished_time = time.time()
            self._groups.pop(group.request_id, None)
        first = group.seqs[0]
        prompt_logprobs = self._take_prompt_logprobs(group, finished) if self._prompt_logprobs else None
        return RequestOutput(group.request_id, first.token_ids[:first.num_prompt_tokens], completions, finished,
                             error, group.num_cached_tokens, group.metrics, None, prompt_logprobs)

    def _take_prompt_logprobs(self, group: SequenceGroup, finished: bool) -> list[TokenLogprobs | None] | None:
        """The request's prompt logprobs once complete, handed over once; a request that ends before they
        are complete (aborted, failed) drops them."""
        entries = self._prompt_logprobs.get(group.request_id)
        if entries is None:
            return None
        complete = len(entries) == group.seqs[0].num_prompt_tokens
        if complete or finished:
            del self._prompt_logprobs[group.request_id]
        return entries if complete else None

    @staticmethod
    def _delta(group: SequenceGroup, seq: Sequence) -> CompletionOutput:
        start, seq.num_emitted_tokens = seq.num_emitted_tokens, len(seq.token_ids) - seq.num_prompt_tokens
        wants_logprobs = group.params.logprobs is not None
        return CompletionOutput(
            seq.index, seq.token_ids[seq.num_prompt_tokens + start:], "",
            seq.logprobs[start:] if wants_logprobs else None,
            seq.cumulative_logprob if wants_logprobs or group.beam is not None else None,
            seq.status.finish_reason)

    # ---- introspection --------------------------------------------------
    def prefix_cache_summary(self) -> tuple[int, set[bytes]]:
        """(block size, the hash of every block a new prompt could hit now), for routing by cached prefix
        across engines; (0, empty) without prefix caching."""
        if not self.scheduler.config.enable_prefix_caching:
            return 0, set()
        return self.scheduler.config.block_size, self.scheduler.kv.cached_block_hashes()

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()
        stats.grammar_mask_seconds_total = self.grammar.mask_seconds
        stats.grammar_mask_steps_total = self.grammar.mask_steps
        stats.spec_decode_proposal_seconds_total = self._propose_seconds
        stats.spec_decode_verification_seconds_total = self._verify_seconds
        return stats

    def kv_snapshot(self) -> KVSnapshot:
        """The KV pools block by block and the requests holding them, with ``stats()`` of the same
        moment (the dashboard's). Costs a few passes over the blocks: call it between steps, sparingly."""
        return self.scheduler.kv_snapshot(self.stats())


def _new_seqs(prompt: list[int], resume: ResumeState | None) -> list[Sequence]:
    """A new request's one sequence (it forks its n after the prompt), or a resumed request's n
    choices holding their delivered tokens (already emitted), as after a recompute preemption.
    The delivered tokens' logprobs are unknown: empty placeholders keep ``logprobs`` indexed by
    output position (they are never emitted)."""
    if resume is None:
        return [Sequence(prompt, len(prompt))]
    return [Sequence(prompt + list(out), len(prompt), index, SequenceStatus(reason or "waiting"),
                     logprobs=[[] for _ in out], num_emitted_tokens=len(out))
            for index, (out, reason) in enumerate(zip(resume.output_token_ids, resume.finish_reasons))]
