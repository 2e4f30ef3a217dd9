"""The engine's figures; each field declares its Prometheus name, kind and help once
(counters without the ``_total`` the Prometheus client appends on export)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _gauge(name: str, help_text: str, **default: Any) -> Any:
    return field(metadata={"prometheus": name, "kind": "gauge", "help": help_text}, **default)


def _counter(name: str, help_text: str, **default: Any) -> Any:
    return field(metadata={"prometheus": name, "kind": "counter", "help": help_text}, **default)


@dataclass(slots=True)
class EngineStats:
    num_requests_running: int = _gauge("vllm:num_requests_running", "Requests in the running batch.")
    num_requests_waiting: int = _gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.")
    num_requests_swapped: int = _gauge("vllm:num_requests_swapped", "Requests preempted to the CPU swap pool.")
    # 0-1 fractions: vLLM exports this very fraction under the "_perc" name, so dashboards carry over.
    kv_cache_usage: float = _gauge("vllm:kv_cache_usage_perc", "Used KV blocks / KV blocks (0-1).")
    kv_token_utilization: float = _gauge("pagedserve:kv_token_utilization_perc", "Stored tokens / used-block slots (0-1).")
    num_blocks_total: int = _gauge("pagedserve:num_blocks_total", "KV blocks on the device.")
    num_blocks_free: int = _gauge("pagedserve:num_blocks_free", "Free KV blocks on the device.")
    num_blocks_cached: int = _gauge("pagedserve:num_blocks_cached", "Free KV blocks holding a cached prefix.")
    num_blocks_used: int = _gauge("pagedserve:num_blocks_used", "KV blocks in use on the device.")
    num_cpu_blocks_total: int = _gauge("pagedserve:num_cpu_blocks_total", "KV blocks of the CPU swap pool.")
    num_cpu_blocks_used: int = _gauge("pagedserve:num_cpu_blocks_used", "KV blocks in use in the CPU swap pool.")
    kv_tokens_stored: int = _gauge("pagedserve:kv_tokens_stored", "Token slots holding K/V.")
    kv_reserved_slots: int = _gauge("pagedserve:kv_reserved_slots", "Token slots claimed, K/V not written yet.")
    kv_internal_frag_slots: int = _gauge("pagedserve:kv_internal_frag_slots", "Slots lost to internal fragmentation.")
    kv_external_frag_slots: int = _gauge("pagedserve:kv_external_frag_slots", "Slots lost to external fragmentation.")
    kv_free_slots: int = _gauge("pagedserve:kv_free_slots", "Free token slots not counted as fragmentation.")
    num_preemptions_total: int = _counter("vllm:num_preemptions", "Preempted requests.")
    prefix_cache_queries_total: int = _counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the cache.")
    prefix_cache_hits_total: int = _counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
    prompt_tokens_total: int = _counter("vllm:prompt_tokens", "Prompt tokens of requests received.")
    generation_tokens_total: int = _counter("vllm:generation_tokens", "Generated tokens.")
    num_swapped_out_blocks_total: int = _counter("pagedserve:num_swapped_out_blocks", "KV blocks swapped out to CPU.")
    num_swapped_in_blocks_total: int = _counter("pagedserve:num_swapped_in_blocks", "KV blocks swapped back in.")
    num_window_released_blocks_total: int = _counter("pagedserve:num_window_released_blocks", "KV blocks released "
                                                     "behind the sliding window while their sequence runs.", default=0)
    # A hybrid model's recurrent-state slots (engine/core/state_cache.py); 0 for attention-only models.
    num_state_slots_total: int = _gauge("pagedserve:num_state_slots_total", "Recurrent-state slots for sequences "
                                        "(hybrid models).", default=0)
    num_state_slots_used: int = _gauge("pagedserve:num_state_slots_used", "Recurrent-state slots held by "
                                       "sequences.", default=0)
    num_state_snapshots_total: int = _gauge("pagedserve:num_state_snapshots_total", "Recurrent-state snapshot "
                                            "slots for prefix-cache hits.", default=0)
    num_state_snapshots_used: int = _gauge("pagedserve:num_state_snapshots_used", "Recurrent-state snapshots "
                                           "kept (or being written).", default=0)
    state_snapshot_hits_total: int = _counter("pagedserve:state_snapshot_hits", "Admissions that restored a "
                                              "recurrent-state snapshot (a hybrid model's prefix hit).", default=0)
    # Set by the engine (the scheduler knows no grammar): a benchmark reports seconds / steps per step.
    grammar_mask_seconds_total: float = _counter("pagedserve:grammar_mask_seconds", "Seconds filling and applying "
                                                 "structured-output token masks.", default=0.0)
    grammar_mask_steps_total: int = _counter("pagedserve:grammar_mask_steps", "Steps that masked constrained rows.",
                                             default=0)
    # Speculative decoding (vLLM's names): verifications, the draft tokens they verified and accepted.
    spec_decode_num_drafts_total: int = _counter("vllm:spec_decode_num_drafts", "Verifications of proposed "
                                                 "tokens (a sequence's step with drafts).", default=0)
    spec_decode_num_draft_tokens_total: int = _counter("vllm:spec_decode_num_draft_tokens", "Proposed tokens "
                                                       "verified.", default=0)
    spec_decode_num_accepted_tokens_total: int = _counter("vllm:spec_decode_num_accepted_tokens", "Proposed "
                                                          "tokens accepted.", default=0)
    spec_decode_acceptance_rate: float = field(default=0.0, metadata={
        "prometheus": "vllm:spec_decode_draft_acceptance_rate", "kind": "gauge",
        "help": "Accepted / verified proposed tokens (0-1)."})
    spec_decode_mean_accepted_length: float = field(default=0.0, metadata={
        "prometheus": "pagedserve:spec_decode_mean_accepted_length", "kind": "gauge",
        "help": "Tokens a verification emits on average: 1 + accepted drafts."})
    # Set by the engine: seconds proposing (n-gram lookup, draft model) and in steps that verified drafts.
    spec_decode_proposal_seconds_total: float = _counter("pagedserve:spec_decode_proposal_seconds", "Seconds "
                                                         "proposing tokens.", default=0.0)
    spec_decode_verification_seconds_total: float = _counter("pagedserve:spec_decode_verification_seconds",
                                                             "Seconds in steps that verified proposed tokens.",
                                                             default=0.0)
