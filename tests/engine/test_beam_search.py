"""Beam search == transformers generate(num_beams=W, num_return_sequences=W, do_sample=False), token for token
and in order, fp32; and the block tree it leaves behind (sharing, copy-on-write, frees)."""
from __future__ import annotations

import copy

import pytest
import torch

from engine import LLM, BeamSearchParams, LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.sequence import SequenceStatus
from .conftest import ARCH_CONFIGS, build_checkpoint, mixed_prompts

MAX_NEW = 10
# A token each random tiny model generates often, made its eos so hypotheses finish early.
EOS = {"llama": 215, "qwen2": 222, "opt": 67}
# prompts 0..3 of mixed_prompts: 9 to 61 tokens, 2 and 4 share a 40-token prefix.
PROMPTS = mixed_prompts(4)
# 4 requests x 4 candidates need ~30 blocks of 16: 20 force preemption (and a recomputed group of
# 4 candidates of up to 71 tokens, counted unshared at admission, still fits).
SCENARIOS = {
    "plain": dict(enable_prefix_caching=False),
    "recompute": dict(num_device_blocks=20, preemption_mode="recompute", enable_prefix_caching=False),
    "swap": dict(num_device_blocks=20, num_cpu_blocks=20, preemption_mode="swap", enable_prefix_caching=False),
    "chunked-recompute": dict(num_device_blocks=20, preemption_mode="recompute", max_num_batched_tokens=16,
                              enable_chunked_prefill=True),
}


@pytest.fixture(scope="module", params=sorted(EOS))
def beam_checkpoint(request, tmp_path_factory):
    config = ARCH_CONFIGS[request.param]()
    config.eos_token_id = EOS[request.param]
    return request.param, build_checkpoint(request.param, tmp_path_factory.mktemp(f"beam-{request.param}"),
                                           config=config)


@torch.inference_mode()
def hf_beams(model, prompt: list[int], width: int, eos: int | None, length_penalty: float,
             early_stopping: bool | str) -> list[tuple[list[int], float]]:
    """transformers' hypotheses, best first: (generated tokens, cumulative logprob)."""
    config = copy.deepcopy(model.generation_config)
    # None would fall back to the checkpoint's eos; an id outside the vocabulary never stops (and, as for
    # none, transformers keeps 2 * width candidates per step).
    config.eos_token_id = 2**20 if eos is None else eos
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, do_sample=False,
                         num_beams=width, num_return_sequences=width, max_new_tokens=MAX_NEW, pad_token_id=0,
                         length_penalty=length_penalty, early_stopping=early_stopping,
                         return_dict_in_generate=True, output_scores=True)
    lengths = (out.beam_indices >= 0).sum(-1).tolist()
    scores = out.sequences_scores.tolist()  # cumulative / length ** length_penalty
    return [(out.sequences[i, len(prompt):len(prompt) + n].tolist(), scores[i] * n ** length_penalty)
            for i, n in enumerate(lengths)]


def make_llm(path: str, **overrides) -> LLM:
    config = dict(attention_backend="torch", dtype="float32", num_device_blocks=256, show_progress=False)
    return LLM(path, skip_tokenizer_init=True, **(config | overrides))


def check_against_hf(llm: LLM, model, arch: str, width: int, with_eos: bool, length_penalty: float = 1.0,
                     early_stopping: bool | str = False, prompts: list[list[int]] = PROMPTS) -> None:
    params = BeamSearchParams(width, MAX_NEW, length_penalty, early_stopping, ignore_eos=not with_eos)
    results = llm.beam_search(prompts, params, use_tqdm=False)
    for prompt, result in zip(prompts, results):
        want = hf_beams(model, prompt, width, EOS[arch] if with_eos else None, length_penalty, early_stopping)
        assert [s.token_ids for s in result.sequences] == [tokens for tokens, _ in want]
        got = [s.cumulative_logprob for s in result.sequences]
        assert got == pytest.approx([cum for _, cum in want], abs=1e-4)
    stats = llm.engine.stats()
    assert stats.num_blocks_free == stats.num_blocks_total  # every candidate's blocks came back


# (width, eos, length_penalty, early_stopping): the fast set covers each width and each early_stopping mode.
CASES = [(2, True, 1.0, False), (4, True, 0.5, True), (8, False, 1.0, False), (4, True, 2.0, "never")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"W{c[0]}-eos{int(c[1])}-lp{c[2]}-es{c[3]}")
def test_matches_transformers(beam_checkpoint, case):
    arch, ckpt = beam_checkpoint
    check_against_hf(make_llm(ckpt.path), ckpt.hf_model, arch, *case)


@pytest.mark.slow
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("with_eos", [True, False])
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_matches_transformers_everywhere(beam_checkpoint, width, with_eos, early_stopping):
    arch, ckpt = beam_checkpoint
    check_against_hf(make_llm(ckpt.path), ckpt.hf_model, arch, width, with_eos, 1.0, early_stopping)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_preemption_keeps_results(beam_checkpoint, scenario):
    arch, ckpt = beam_checkpoint
    if arch != "llama":
        pytest.skip("llama by default (slow set: every family)")
    llm = make_llm(ckpt.path, **SCENARIOS[scenario])
    check_against_hf(llm, ckpt.hf_model, arch, 4, True)
    stats = llm.engine.stats()
    if scenario != "plain":
        assert stats.num_preemptions_total > 0
    if scenario == "swap":
        assert stats.num_swapped_out_blocks_total > 0 and stats.num_swapped_in_blocks_total > 0


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_preemption_every_family(beam_checkpoint, scenario):
    arch, ckpt = beam_checkpoint
    check_against_hf(make_llm(ckpt.path, **SCENARIOS[scenario]), ckpt.hf_model, arch, 4, True)


def test_prefix_cache_hits(beam_checkpoint):
    arch, ckpt = beam_checkpoint
    if arch != "llama":
        pytest.skip("llama by default")
    llm = make_llm(ckpt.path, enable_prefix_caching=True)
    check_against_hf(llm, ckpt.hf_model, arch, 4, True)
    hits = llm.engine.stats().prefix_cache_hits_total
    check_against_hf(llm, ckpt.hf_model, arch, 4, True)  # the prompts' full blocks are cached now
    assert llm.engine.stats().prefix_cache_hits_total > hits


def _expected_blocks(group, block_size: int) -> int:
    """Distinct blocks the candidates' ancestry implies: candidates hold one block per distinct computed
    prefix ending in that block (forks share every block they had; a shared partial block is copied at
    the next write, so later tokens are never shared)."""
    keys = set()
    for seq in group.seqs:
        n = seq.num_computed_tokens
        keys.update(tuple(seq.token_ids[:min((j + 1) * block_size, n)]) for j in range(-(-n // block_size)))
    return len(keys)


def test_block_tree_and_abort(beam_checkpoint):
    arch, ckpt = beam_checkpoint
    if arch != "llama":
        pytest.skip("llama by default")
    engine = LLMEngine(EngineConfig(model=ckpt.path, attention_backend="torch", dtype="float32",
                                    num_device_blocks=64, block_size=8, show_progress=False))
    params = SamplingParams(n=2, best_of=6, use_beam_search=True, max_tokens=MAX_NEW, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), prompt[:13], params)
    sched, kv, forked = engine.scheduler, engine.scheduler.kv, 0
    for step in range(MAX_NEW + 2):
        engine.step()
        for group in sched.running.values():
            ids = [b for seq in group.seqs for b in kv.block_ids(seq.seq_id)]
            assert len(set(ids)) == _expected_blocks(group, 8)
            forked += len(set(ids)) < len(ids)
        if step == 4:  # abort one search mid-way: its candidates' blocks go at once
            victim = sched.requests["1"]
            engine.abort_request("1")
            assert all(seq.seq_id not in kv.tables for seq in victim.seqs)
            live = {b for g in sched.running.values() for s in g.seqs for b in kv.block_ids(s.seq_id)}
            assert kv.num_free_blocks == kv.num_blocks - len(live)
    assert forked  # candidates did share blocks
    assert not engine.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks
    assert all(s.status is not SequenceStatus.RUNNING for g in sched.requests.values() for s in g.seqs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=3, best_of=2, use_beam_search=True), "n .3. must be <= best_of"),
    (dict(n=1, best_of=2), "best_of different from n needs use_beam_search"),
    (dict(use_beam_search=True, top_k=5), "top_k is not supported with use_beam_search"),
    (dict(use_beam_search=True, early_stopping="sometimes"), "early_stopping must be one of"),
])
def test_invalid_beam_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_beam_search_params_map_onto_sampling_params():
    p = BeamSearchParams(3, 7, length_penalty=0.5, early_stopping="never").to_sampling_params()
    assert (p.use_beam_search, p.beam_width, p.n, p.max_tokens, p.length_penalty, p.early_stopping, p.greedy) == \
        (True, 3, 3, 7, 0.5, "never", True)
