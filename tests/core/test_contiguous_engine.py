"""The contiguous baselines on the real engine: same kernels and runner, same
tokens as HF transformers, every run returned to the arena."""
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.conftest import build_checkpoint, hf_greedy, mixed_prompts

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama-contiguous"))


@pytest.mark.parametrize("allocator", ["contiguous-max", "contiguous-pow2", "contiguous-oracle"])
def test_contiguous_allocators_generate_what_hf_generates(checkpoint, allocator):
    # 32 blocks of 8: contiguous-max reserves 8 blocks per request, so requests queue for runs.
    engine = LLMEngine(EngineConfig(model=checkpoint.path, kv_allocator=allocator, block_size=8, num_device_blocks=32,
                                    max_model_len=64, attention_backend="torch", show_progress=False, num_threads=1))
    prompts = [p[:40] for p in mixed_prompts(8)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    peak = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        stats = engine.stats()
        peak = max(peak, stats.num_requests_running)
        assert (stats.kv_tokens_stored + stats.kv_reserved_slots + stats.kv_internal_frag_slots
                + stats.kv_external_frag_slots + stats.kv_free_slots) == 32 * 8
    expected = [hf_greedy(checkpoint.hf_model, p, MAX_TOKENS) for p in prompts]
    assert [tokens[str(i)] for i in range(len(prompts))] == expected
    if allocator == "contiguous-max":
        assert peak == 4  # 32 blocks / 8-block runs
    stats = engine.stats()
    assert stats.num_blocks_free == stats.num_blocks_total and stats.kv_token_utilization == 0.0


def test_parallel_sampling_is_refused_on_contiguous_allocators(checkpoint):
    engine = LLMEngine(EngineConfig(model=checkpoint.path, kv_allocator="contiguous-oracle", num_device_blocks=16,
                                    max_model_len=64, attention_backend="torch", show_progress=False, num_threads=1))
    with pytest.raises(ValueError, match="needs kv_allocator='paged'"):
        engine.add_request("a", [1, 2, 3], SamplingParams(n=2, max_tokens=4))
    assert not engine.has_unfinished_requests()
