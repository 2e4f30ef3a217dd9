"""A stand-in for LLMEngine in worker and gateway tests."""
from __future__ import annotations

import time

from engine.core.kv_snapshot import USED, KVSnapshot, PoolSnapshot, SnapshotRequest
from engine.outputs import CompletionOutput, RequestOutput, ResumeState
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from tests.service.conftest import engine_stats

BOOM_ON_ADD = 13  # a prompt starting with this token makes add_request blow up
BOOM_ON_STEP = 14  # ... and with this one, the next step
FAIL_ON_STEP = 15  # ... and with this one, the next step fails the request (as LLMEngine fails a bad one alone)


class FakeEngine:
    """The LLMEngine API in miniature: each step emits one token per request
    (66, 67, ...); a resumed request continues the count
    after its delivered tokens (``resumed`` records each ResumeState). An embedding request (PoolingParams) ends
    at its next step with its prompt's first ids as its vector."""

    max_model_len = 2048

    def __init__(self, step_s: float = 0.0, faults: bool = True, snapshot_s: float = 0.0) -> None:
        self.step_s = step_s  # each step sleeps this long (on the worker's step thread)
        self.snapshot_s = snapshot_s  # each KV snapshot takes this much CPU time
        self.num_snapshots = 0
        self.faults = faults  # the BOOM_* / FAIL_ON_STEP prompts fail (off: every prompt is served)
        self.requests: dict[str, list] = {}
        self.pooled: dict[str, list[float]] = {}  # embedding requests: their vectors, given at the next step
        self.added: list[str] = []
        self.resumed: dict[str, ResumeState] = {}
        self.failing: set[str] = set()
        self.capacity = True
        self._boom = False
        self.priorities: dict[str, int] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    resume: ResumeState | None = None, priority: int = 0, images: list | None = None) -> None:
        self.priorities[request_id] = priority
        if self.faults and prompt_token_ids[0] == BOOM_ON_ADD:
            raise RuntimeError("boom")
        self._boom |= self.faults and prompt_token_ids[0] == BOOM_ON_STEP
        if isinstance(params, PoolingParams):
            self.pooled[request_id] = [float(t) for t in prompt_token_ids[:4]]
        else:
            self.requests[request_id] = [params.max_tokens, len(resume.output_token_ids[0]) if resume else 0]
        if self.faults and prompt_token_ids[0] == FAIL_ON_STEP:
            self.failing.add(request_id)
        if resume is not None:
            self.resumed[request_id] = resume
        self.added.append(request_id)

    def abort_request(self, request_ids) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.requests.pop(request_id, None)
            self.pooled.pop(request_id, None)

    def step(self) -> list:
        time.sleep(self.step_s)
        if self._boom:
            self._boom = False
            raise RuntimeError("kaboom")
        outputs = [RequestOutput(rid, [], [], finished=True, error="device error") for rid in self.failing]
        for request_id in self.failing:
            self.requests.pop(request_id, None)
        self.failing.clear()
        outputs += [RequestOutput(rid, [], [CompletionOutput(0, [], finish_reason="stop")], finished=True,
                                  embedding=vector) for rid, vector in self.pooled.items()]
        self.pooled.clear()
        for request_id, state in list(self.requests.items()):
            state[1] += 1
            done = state[1] == state[0]
            reason = "length" if done else None
            outputs.append(RequestOutput(request_id, [], [CompletionOutput(0, [65 + state[1]], finish_reason=reason)],
                                         finished=done))
            if done:
                del self.requests[request_id]
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.pooled)

    def has_capacity(self) -> bool:
        return self.capacity

    def prefix_cache_summary(self) -> tuple[int, set[bytes]]:
        return 0, set()

    def stats(self) -> EngineStats:
        return engine_stats(num_requests_running=len(self.requests))

    def kv_snapshot(self) -> KVSnapshot:
        """A pool of 16 blocks of 4 slots: request i holds block i, filled with its token count."""
        busy_until = time.thread_time() + self.snapshot_s
        while time.thread_time() < busy_until:
            pass
        self.num_snapshots += 1
        pool = PoolSnapshot.empty(16)
        requests = []
        for i, (request_id, (_, done)) in enumerate(list(self.requests.items())[:16]):
            pool.state[i], pool.ref_count[i], pool.filled[i] = USED, 1, min(done, 4)
            requests.append(SnapshotRequest(request_id, "running", 1, [i]))
        pool.set_owners([r.block_ids for r in requests])
        return KVSnapshot(time.time(), 4, pool, PoolSnapshot.empty(0), requests, self.stats())
