"""The step-driven engine: requests in, incremental token outputs out.

Each ``step`` is one pass down the stages, each with one owner: the scheduler picks the batch (with the proposed
tokens to verify and the grammar mask), the runner computes its logits, the sampler draws everything the step
needs, and ``Scheduler.update_from_output`` records it and returns the ``RequestOutput``s. The scheduler is the
one registry of requests; the engine keeps no request state."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from engine.async_step import StepPipeline, runs_ahead
from engine.config import EngineConfig
from engine.context_length import check_input_length, fit_max_tokens
from engine.core.grammar import StructuredOutputManager
from engine.core.kv_snapshot import KVSnapshot
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.core.speculation import Speculation
from engine.distributed.executor import create_executor
from engine.multimodal.config import VisionSpec
from engine.multimodal.encoder_budget import EncoderBudget
from engine.multimodal.images import RequestImages
from engine.multimodal.inputs import ImagePatches
from engine.outputs import RequestOutput, ResumeState
from engine.pooler_config import PoolerConfig
from engine.pooling_params import PoolingParams, ResolvedPooling
from engine.sampler import Sampler, SamplerOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.spec_decode.speculator import Speculator, make_speculator
from engine.stats import EngineStats
from engine.structured_output import check_structured_output

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
        grammar = StructuredOutputManager(self._tokenizer_info, config.max_grammar_bytes,
                                          self.config.model_config.vocab_size)
        self.scheduler = Scheduler(self.config.scheduler, self.eos_token_ids, grammar)
        self.sampler = Sampler(self.eos_token_ids, config.seed, self.config.device, self.runner.ops)
        self._pipeline = StepPipeline(self.runner) if config.async_scheduling else None
        self.speculator: Speculator | None = make_speculator(config, self.config)
        self._scheduled_at = 0.0  # when the latest step was scheduled (the verification time of its step)
        self.pooler_config = PoolerConfig.from_model_dir(self.config.model_config.path)
        model_config = self.config.model_config
        self.images = RequestImages(VisionSpec.from_hf(model_config.hf), model_config.architecture)
        if self.images.spec is not None:  # the runner's step splices the encoder cache's embeddings
            self.runner.images = self.images.step(self.runner.model, config.encoder_cache_tokens)
            self.scheduler.encoder_budget = EncoderBudget(
                config.max_num_encoder_tokens or config.max_num_batched_tokens, self.runner.images.cache,
                whole_images=_whole_images(self.images.spec, config.max_num_batched_tokens))

    # ---- requests -------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    resume: ResumeState | None = None, priority: int = 0,
                    images: list[ImagePatches] | None = None) -> None:
        """Queue a request. ``resume``: the request ran elsewhere and its engine died; it continues
        from the tokens already delivered (recomputed as context) exactly as an undisturbed run would,
        and ``step`` returns only the new tokens. See ``ResumeState`` for what is not carried over.
        ``priority``: lower is scheduled first and preempted last (vLLM's convention); equal ones go by arrival.
        ``params.prompt_logprobs`` come with the first output; a resumed request that had delivered tokens
        already had them, so they are not computed again (one that had delivered none gets them).
        ``PoolingParams``: an embedding request, its prompt's prefill only; its one output carries the vector
        (``RequestOutput.embedding``) and no tokens. ``images``: a vision-language model's, one per placeholder
        run of the prompt (its tokens expanded, ``engine.multimodal.processor.expand_image_tokens``)."""
        pooling = None
        if isinstance(params, PoolingParams):
            pooling, params = self._pooling(prompt_token_ids, params, resume), _embedding_sampling_params()
        else:
            self._validate(prompt_token_ids, params)
        if resume is not None:
            self._validate_resume(prompt_token_ids, params, resume)
        multimodal, salt = self.images.inputs(prompt_token_ids, images or [], cache_salt.encode() if cache_salt
                                              else None)
        group = SequenceGroup(request_id, _new_seqs(list(prompt_token_ids), resume), params,
                              time.time() if arrival_time is None else arrival_time,
                              cache_salt=salt, priority=priority, pooling=pooling, multimodal=multimodal)
        self.scheduler.add_group(group)

    def _pooling(self, prompt: list[int], params: PoolingParams, resume: ResumeState | None) -> ResolvedPooling:
        if resume is not None:
            raise ValueError("an embedding request has no output to resume: run it again")
        self._check_prompt(prompt)
        check_input_length(len(prompt), self.max_model_len)
        return params.resolve(self.pooler_config)

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        """The engine's edge for offline callers (the gateway checked the same for served requests)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")
        self._check_prompt(prompt)
        if params.logit_bias:
            self._check_token_ids("logit_bias", list(params.logit_bias))
        if params.structured_output is not None:
            check_structured_output(params.structured_output, MAX_STRUCTURED_OUTPUT_CHARS)
        fit_max_tokens(len(prompt), params.max_tokens, self.max_model_len)

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the prompt is empty (it needs at least one token)")
        self._check_token_ids("prompt", prompt)

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
        self.scheduler.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_capacity(self) -> bool:
        s = self.scheduler
        kv = s.kv  # its num_free_blocks / num_blocks directly: stats() also computes fields unused here
        return (not s.waiting and len(s.running) + len(s.swapped) < s.config.max_num_seqs
                and kv.num_free_blocks > _FREE_BLOCK_WATERMARK * kv.num_blocks)

    # ---- one iteration --------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> sample -> update_from_output (``_step_async`` overlaps them)."""
        if self._pipeline is not None:
            return self._step_async()
        out = self._schedule()
        if out.is_empty:
            return self.scheduler.take_unreported()
        try:
            sampled = self.sampler.sample(out, self.runner.execute(out))
        except Exception as exc:  # a failing batch never fails the engine
            return self._recover(out, exc)
        return self._update(out, sampled)

    def _schedule(self) -> SchedulerOutput:
        """The next step, with the proposed tokens to verify when speculating."""
        drafts = self.speculator.propose(self.scheduler.speculation_targets()) if self.speculator else None
        out = self.scheduler.schedule(drafts)
        self._scheduled_at = time.perf_counter()
        return out

    def _update(self, out: SchedulerOutput, sampled: SamplerOutput) -> list[RequestOutput]:
        outputs = self.scheduler.update_from_output(out, sampled)
        if out.num_draft_tokens:
            self.speculator.verify_seconds += time.perf_counter() - self._scheduled_at
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """One step's outputs, the next step scheduled (when ``runs_ahead``) and launched before they are
        processed (engine/async_step.py)."""
        pipeline = self._pipeline
        if pipeline.in_flight is None:
            out = self._schedule()
            if out.is_empty:
                return self.scheduler.take_unreported()
            try:
                pipeline.launch(out, self.runner.plan(out))
            except Exception as exc:
                return self._recover(out, exc)
        current = pipeline.take()
        out, ahead = current.out, None
        if runs_ahead(out, self.scheduler.grammar.active, self.speculator is not None and _speculates(out)):
            ahead = pipeline.schedule_ahead(self.scheduler, out)
        try:
            logits = current.logits.result()
            tokens, values = self.sampler.draw_step(out, logits)
        except Exception as exc:
            outputs = self._recover(out, exc)
            if ahead is not None:
                self.scheduler.unschedule(ahead.out)
            return outputs
        if ahead is not None and not ahead.out.is_empty:
            tokens = pipeline.launch_ahead(ahead, tokens)
        return self._update(out, self.sampler.step_output(out, logits, tokens, values))

    def _recover(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """A batch of several requests is retried one request at a time (``Scheduler.isolate``): one
        bad request never fails its batch-mates. A request that failed alone is failed."""
        self.scheduler.recover_failed_step(out)
        groups = list({id(s.group): s.group for s in out.scheduled}.values())
        if len(groups) > 1:
            logger.warning("step failed (%s: %s); retrying its %d requests one at a time",
                           type(exc).__name__, exc, len(groups))
            self.scheduler.isolate(groups)
        else:
            logger.exception("step failed; failing its request")
            self.scheduler.fail([g.request_id for g in groups], f"internal error while running the batch: {exc}")
        return self.scheduler.take_unreported()

    def _tokenizer_info(self):
        """For the grammar compiler, built on the first constrained request."""
        import transformers
        import xgrammar

        tokenizer = transformers.AutoTokenizer.from_pretrained(self.config.tokenizer)
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.config.model_config.vocab_size,
                                                       stop_token_ids=sorted(self.eos_token_ids) or None)

    # ---- introspection --------------------------------------------------
    def prefix_cache_summary(self) -> tuple[int, set[bytes]]:
        """(block size, the hash of every block a new prompt could hit now), for routing by cached prefix
        across engines; (0, empty) without prefix caching."""
        if not self.scheduler.config.enable_prefix_caching:
            return 0, set()
        return self.scheduler.config.block_size, self.scheduler.kv.cached_block_hashes()

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()
        stats.grammar_mask_seconds_total = self.scheduler.grammar.mask_seconds
        stats.grammar_mask_steps_total = self.scheduler.grammar.mask_steps
        if self.speculator is not None:
            stats.spec_decode_proposal_seconds_total = self.speculator.propose_seconds
            stats.spec_decode_verification_seconds_total = self.speculator.verify_seconds
        return stats

    def kv_snapshot(self) -> KVSnapshot:
        """The KV pools block by block and the requests holding them, with ``stats()`` of the same
        moment (the dashboard's). Costs a few passes over the blocks: call it between steps, sparingly."""
        return self.scheduler.kv_snapshot(self.stats())


def _embedding_sampling_params() -> SamplingParams:
    """An embedding request's sampling params: it draws nothing; one token of room lets a prompt fill the
    context (``fit_max_tokens``), and it takes no part in speculation."""
    return SamplingParams(max_tokens=1, temperature=0.0, use_speculation=False)


def _speculates(out: SchedulerOutput) -> bool:
    """Whether a request of ``out`` speculates: its next proposals read this step's tokens."""
    return any(Speculation.eligible(s.group) for s in out.scheduled)


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


def _whole_images(spec: VisionSpec, max_num_batched_tokens: int) -> bool:
    """Whether prefill chunks must hold an image whole (Gemma 3's attend to themselves both ways): then a step's
    token budget must hold one."""
    if spec.wrap is None:
        return False
    rows = spec.rows((1, spec.wrap.image_size, spec.wrap.image_size))
    if rows > max_num_batched_tokens:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must hold an image's {rows} tokens: "
                         "a prefill chunk never splits an image, whose tokens attend to each other both ways")
    return True
