"""Request priorities on a real engine: a higher-priority arrival runs at once (one a step), pushing lower-priority requests
out of a pool too small for all (recompute and swap), is itself never preempted by them, and every request's
greedy output is still transformers'."""
from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine

from .conftest import hf_greedy, mixed_prompts
from .test_hf_equivalence import GREEDY

LOW, HIGH = 1, 0  # lower runs first, as in vLLM


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priority_order_holds_under_preemption(llama_checkpoint, mode):
    engine = LLMEngine(EngineConfig(model=llama_checkpoint.path, attention_backend="torch", dtype="float32",
                                    show_progress=False, num_device_blocks=30, block_size=8,
                                    num_cpu_blocks=30 if mode == "swap" else 0, preemption_mode=mode,
                                    enable_prefix_caching=False))
    prompts = mixed_prompts()
    low, high = {f"low{i}": p for i, p in enumerate(prompts[:12])}, {f"high{i}": p for i, p in enumerate(prompts[12:15])}
    tokens: dict[str, list[int]] = {request_id: [] for request_id in low | high}
    first_step: dict[str, int] = {}
    for request_id, prompt in low.items():
        engine.add_request(request_id, prompt, GREEDY, priority=LOW)
    step, finished = 0, {}
    while engine.has_unfinished_requests():
        if step == 3:
            for request_id, prompt in high.items():
                engine.add_request(request_id, prompt, GREEDY, priority=HIGH)
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            first_step.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = out.metrics
        step += 1
    # Each step admits the waiting head, preempting for it what it needs: one high-priority arrival a step here.
    assert [first_step[request_id] for request_id in high] == [3, 4, 5]
    assert all(finished[request_id].num_preemptions == 0 for request_id in high)
    assert sum(finished[request_id].num_preemptions for request_id in low) > 0
    for request_id, prompt in (low | high).items():
        assert tokens[request_id] == hf_greedy(llama_checkpoint.hf_model, prompt, GREEDY.max_tokens), request_id
