"""The step-driven engine: requests in, incremental token outputs out.

Each ``step``: the scheduler picks the batch, the runner computes its logits,
the sampler draws the tokens, and ``Scheduler.update_from_output`` records
them (forks, stops, frees); the engine turns the groups that got tokens into
incremental ``RequestOutput``s."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

import torch

import cuda_ext
from engine.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.demo_model import ensure_demo_model
from engine.loader import load_model
from engine.model_runner import ModelRunner, resolve_kv_blocks
from engine.models.config import read_model_config, resolve_dtype
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampler import Sampler, SamplerOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)

# has_capacity() keeps this share of the pool free for the running seqs to grow into.
_FREE_BLOCK_WATERMARK = 0.05


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config = dataclasses.replace(config)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        config.model = config.model or ensure_demo_model()
        model_config = read_model_config(config.model)
        self.model_path = config.model
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids: set[int] = set(model_config.eos_token_ids)
        self.max_model_len = _resolve_max_model_len(config.max_model_len, model_config.max_position_embeddings)
        config.max_model_len = self.max_model_len
        device = torch.device(config.device)
        dtype = resolve_dtype(config.dtype, model_config.dtype, device.type)
        model = load_model(model_config, device, dtype, config.show_progress)
        resolve_kv_blocks(config, model_config, dtype, device)
        self.config = config
        self.runner = ModelRunner(model, model_config, config, cuda_ext.load_ops(config.attention_backend), device, dtype)
        self.scheduler = Scheduler(config, self.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, config.seed, device)
        self._groups: dict[str, SequenceGroup] = {}
        self._aborted: list[SequenceGroup] = []
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0

    # ---- requests -------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        self._validate(request_id, prompt_token_ids, params)
        seq = Sequence(list(prompt_token_ids), len(prompt_token_ids))
        group = SequenceGroup(request_id, [seq], params, time.time() if arrival_time is None else arrival_time,
                              cache_salt=cache_salt.encode() if cache_salt else None)
        self.scheduler.add_group(group)
        self._groups[request_id] = group
        self._prompt_tokens_total += len(prompt_token_ids)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not prompt:
            raise ValueError("the prompt is empty (it needs at least one token)")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got range [{min(prompt)}, {max(prompt)}]")
        wanted = len(prompt) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise ValueError(f"this model's maximum context length (max_model_len) is {self.max_model_len} tokens; "
                             f"the prompt has {len(prompt)} tokens and {params.max_tokens or 1} more were requested "
                             f"(max_tokens), {wanted} in total")

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        known = [i for i in ids if i in self._groups]
        if known:
            self._aborted += self.scheduler.abort(known)
            for request_id in known:
                del self._groups[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._aborted)

    def has_capacity(self) -> bool:
        s = self.scheduler
        kv = s.kv  # its num_free_blocks / num_blocks directly: stats() also computes fields unused here
        return (s.num_waiting == 0 and s.num_running + s.num_swapped < self.config.max_num_seqs
                and kv.num_free_blocks > _FREE_BLOCK_WATERMARK * kv.num_blocks)

    # ---- one iteration --------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = [self._final_output(g, SequenceStatus.FINISHED_ABORTED) for g in self._aborted]
        self._aborted.clear()
        out = self.scheduler.schedule()
        for group in out.failed:
            outputs.append(self._final_output(group, SequenceStatus.FINISHED_ERROR, group.error))
        if out.is_empty:
            return outputs
        try:
            logits = self.runner.execute(out)
            return outputs + self._process_samples(out, logits)
        except Exception as exc:  # a failing batch fails its requests, never the engine
            logger.exception("step failed; failing its %d scheduled requests", len(out.scheduled))
            return outputs + self._fail_scheduled(out, f"internal error while running the batch: {exc}")

    def _process_samples(self, out: SchedulerOutput, logits: torch.Tensor | None) -> list[RequestOutput]:
        now = time.time()
        for s in out.scheduled:
            s.group.metrics.first_scheduled_time = s.group.metrics.first_scheduled_time or now
        samples = out.samples()
        groups = self.scheduler.update_from_output(out, self._sample(samples, logits))
        self._generation_tokens_total += len(samples)
        return [self._step_output(g, now) for g in groups]

    def _sample(self, samples: list[tuple[int, ScheduledSeq, Sequence]], logits: torch.Tensor | None) -> SamplerOutput:
        if not samples:
            return SamplerOutput([], [])
        rows = [row for row, _, _ in samples]
        if len(rows) != logits.shape[0]:  # forks draw several tokens from one row
            logits = logits[rows]
        return self.sampler(logits, [seq for _, _, seq in samples], [s.group.params for _, s, _ in samples])

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
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        completions = [self._delta(group, seq) for seq in group.seqs if seq.num_output_tokens > seq.num_emitted_tokens]
        return self._request_output(group, completions, None)

    def _final_output(self, group: SequenceGroup, status: SequenceStatus, error: str | None = None) -> RequestOutput:
        self._groups.pop(group.request_id, None)
        completions = [self._delta(group, seq) for seq in group.seqs if seq.status is status]
        return self._request_output(group, completions, error)

    def _request_output(self, group: SequenceGroup, completions: list[CompletionOutput], error: str | None) -> RequestOutput:
        finished = group.is_finished
        if finished:
            group.metrics.finished_time = time.time()
            self._groups.pop(group.request_id, None)
        return RequestOutput(request_id=group.request_id, prompt_token_ids=group.prompt_token_ids,
                             outputs=completions, finished=finished, error=error,
                             num_cached_tokens=group.num_cached_tokens, metrics=group.metrics)

    @staticmethod
    def _delta(group: SequenceGroup, seq: Sequence) -> CompletionOutput:
        start = seq.num_emitted_tokens
        seq.num_emitted_tokens = seq.num_output_tokens
        wants_logprobs = group.params.logprobs is not None
        return CompletionOutput(
            index=seq.index, token_ids=seq.token_ids[seq.num_prompt_tokens + start:],
            logprobs=seq.logprobs[start:] if wants_logprobs else None,
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            finish_reason=seq.status.finish_reason)

    # ---- introspection --------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        s = self.scheduler.stats()
        kv = s.kv
        return {
            "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
            "num_requests_swapped": s.num_swapped, "kv_cache_usage_perc": kv.usage,
            "num_blocks_total": kv.num_blocks, "num_blocks_free": kv.num_free_blocks,
            "num_blocks_cached": kv.num_cached_free_blocks, "num_blocks_used": kv.num_used_blocks,
            "num_cpu_blocks_total": kv.num_cpu_blocks, "num_cpu_blocks_used": kv.num_cpu_used_blocks,
            "kv_tokens_stored": kv.num_tokens_stored, "kv_reserved_slots": kv.num_reserved_slots,
            "kv_internal_frag_slots": kv.num_internal_frag_slots, "kv_external_frag_slots": kv.num_external_frag_slots,
            "kv_free_slots": kv.num_free_slots, "kv_token_utilization_perc": kv.token_utilization,
            "num_preemptions_total": s.num_preemptions,
            "prefix_cache_queries_total": s.prefix_cache_queries, "prefix_cache_hits_total": s.prefix_cache_hits,
            "prompt_tokens_total": self._prompt_tokens_total,
            "generation_tokens_total": self._generation_tokens_total,
            "num_swapped_out_blocks_total": s.num_swapped_out_blocks,
            "num_swapped_in_blocks_total": s.num_swapped_in_blocks,
        }


def _resolve_max_model_len(requested: int | None, model_limit: int) -> int:
    if requested is None:
        return model_limit
    if requested > model_limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings ({model_limit})")
    return requested
