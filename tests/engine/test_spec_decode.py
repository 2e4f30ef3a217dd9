"""Speculative decoding gives the non-speculative engine's outputs: greedy and seeded requests token for token
(with logprobs, stops, max_tokens, n > 1, penalties) under preemption, swapping, prefix caching and async
scheduling; unseeded sampling keeps the target's distribution (a chi-square test); every block comes back."""
from __future__ import annotations

import random

import pytest
import torch
import transformers
from scipy.stats import chisquare

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sequence import Sequence
from engine.spec_decode.ngram import lookup

from .conftest import COMMON, VOCAB, backends, build_checkpoint, mixed_prompts

STOP = 7


def make_engine(path: str, **overrides) -> LLMEngine:
    config = dict(attention_backend="torch", dtype="float32", num_device_blocks=64, show_progress=False,
                  max_model_len=128)
    return LLMEngine(EngineConfig(model=path, **(config | overrides)))


def mixed_params(i: int) -> SamplingParams:
    """Greedy and seeded requests: stop tokens, logprobs, penalties, min_tokens, n > 1, max_tokens ending anywhere."""
    kinds = [
        dict(temperature=0.0, logprobs=2),
        dict(temperature=0.8, top_p=0.9, seed=i),
        dict(temperature=0.0, stop_token_ids=[STOP, 11, 13, 17]),
        dict(temperature=1.0, seed=i, stop_token_ids=[STOP], min_tokens=3, logprobs=1),
        dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
        dict(temperature=0.7, seed=i, n=2),
    ]
    return SamplingParams(max_tokens=4 + (i * 7) % 24, **kinds[i % len(kinds)])


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Each request's choices, from its deltas: [tokens, finish reason, logprob entries' token ids, their
    logprobs]."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    choices: dict[str, dict[int, list]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                choice = choices.setdefault(out.request_id, {}).setdefault(c.index, [[], None, [], []])
                choice[0] += c.token_ids
                choice[1] = c.finish_reason
                choice[2] += [[t for t, _ in entry] for entry in c.logprobs or []]
                choice[3] += [lp for entry in c.logprobs or [] for _, lp in entry]
    stats = engine.stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    return {rid: [by_index[i] for i in sorted(by_index)] for rid, by_index in choices.items()}


def assert_same(got: dict[str, list], expected: dict[str, list]) -> None:
    """Tokens, finish reasons and logprob token ids exactly; logprobs to fp32 rounding (a verification row and a
    decode row reduce in different orders)."""
    strip = lambda outs: {r: [c[:3] for c in choices] for r, choices in outs.items()}  # noqa: E731
    assert strip(got) == strip(expected)
    for r, choices in got.items():
        for c, e in zip(choices, expected[r]):
            assert c[3] == pytest.approx(e[3], abs=1e-4)


def collect(engine: LLMEngine, requests) -> dict[str, list]:
    """As ``run``, but the full outputs accumulated from the deltas (for an oracle)."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    tokens: dict[tuple[tuple[int, ...], int], list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                tokens.setdefault((tuple(out.prompt_token_ids), c.index), []).extend(c.token_ids)
    return tokens


class OracleProposer:
    """Proposes the reference run's own continuation, with one token in each proposal of k + 1 made wrong at a
    position that varies with the length: both full acceptance and rejection at every position happen."""

    def __init__(self, reference: dict[tuple[tuple[int, ...], int], list[int]]) -> None:
        self.reference = reference

    def propose(self, seqs: list[Sequence], ks: list[int], salts: list[bytes | None]) -> list[list[int]]:
        proposals = []
        for seq, k in zip(seqs, ks):
            ref = self.reference.get((tuple(seq.token_ids[:seq.num_prompt_tokens]), seq.index), [])
            drafts = ref[seq.num_output_tokens:seq.num_output_tokens + k]
            wrong = (seq.num_tokens * 5) % (k + 2)
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % VOCAB
            proposals.append(drafts)
        return proposals

    def release_inactive(self) -> None:
        """Keeps nothing per sequence."""


def requests(count: int = 16) -> list[tuple[list[int], SamplingParams]]:
    return [(p, mixed_params(i)) for i, p in enumerate(mixed_prompts(count))]


SETTINGS = {
    "default": {},
    "recompute-preemption": dict(num_device_blocks=14),
    "swap-preemption": dict(num_device_blocks=14, preemption_mode="swap", num_cpu_blocks=64),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "small-budget": dict(max_num_batched_tokens=24),
    "async": dict(async_scheduling=True),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_oracle_proposals_give_the_non_speculative_outputs(llama_checkpoint, setting):
    overrides = SETTINGS[setting]
    reqs = requests()
    plain_engine = make_engine(llama_checkpoint.path, **overrides)
    expected = run(plain_engine, reqs)
    reference = collect(make_engine(llama_checkpoint.path), reqs)
    engine = make_engine(llama_checkpoint.path, speculative_method="ngram", num_speculative_tokens=4, **overrides)
    engine.speculator.proposer = OracleProposer(reference)
    assert_same(run(engine, reqs), expected)
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    assert stats.spec_decode_num_drafts_total > 0 and stats.spec_decode_proposal_seconds_total > 0
    assert stats.generation_tokens_total == plain_engine.stats().generation_tokens_total
    if "preemption" in setting:
        assert stats.num_preemptions_total > 0


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_ngram_proposals_give_the_greedy_outputs(llama_checkpoint, quantization):
    """The real proposer on prompts that repeat themselves; with 4-bit weights too (batch-1 decode's fastest
    form: verification runs the drafts through the same 4-bit layers)."""
    rng = random.Random(1)
    reqs = []
    for _ in range(8):
        phrase = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 8))]
        reqs.append((phrase * 6, SamplingParams(temperature=0.0, max_tokens=30)))
    quantized = {} if quantization is None else dict(quantization=quantization, attention_backend="ext")
    expected = run(make_engine(llama_checkpoint.path, **quantized), reqs)
    engine = make_engine(llama_checkpoint.path, speculative_method="ngram", ngram_prompt_lookup_min=1, **quantized)
    if quantization and torch.ops.pagedserve.skinny_linear_w4_supports():  # the 4-bit layers in compiled calls
        assert all(layer.fused is not None for layer in engine.runner.model.model.layers)
    assert_same(run(engine, reqs), expected)
    assert engine.stats().spec_decode_num_drafts_total > 0


@pytest.mark.parametrize("draft, setting", [("same", "recompute-preemption"), ("other", "recompute-preemption"),
                                            ("same", "small-budget")])
def test_draft_model_proposals_give_the_non_speculative_outputs(llama_checkpoint, tmp_path_factory, draft, setting):
    """A draft model: the target's own checkpoint (nearly every proposal accepted) or another architecture with
    the same vocabulary (mostly rejected), under recompute preemption, or a budget that leaves sequences out of
    steps (their proposal is made again)."""
    path = llama_checkpoint.path if draft == "same" else build_checkpoint("qwen2", tmp_path_factory.mktemp("d")).path
    reqs = requests(10)
    expected = run(make_engine(llama_checkpoint.path, **SETTINGS[setting]), reqs)
    engine = make_engine(llama_checkpoint.path, speculative_method="draft", speculative_model=path,
                         num_speculative_tokens=3, **SETTINGS[setting])
    assert_same(run(engine, reqs), expected)
    stats = engine.stats()
    assert stats.spec_decode_num_drafts_total > 0
    assert stats.num_preemptions_total > 0 or setting == "small-budget"
    rate = stats.spec_decode_acceptance_rate
    assert rate > 0.5 if draft == "same" else rate < 0.3  # greedy rows: 1.0 with the same model
    engine.step()  # the proposing stage of the next step drops what the draft kept for ended sequences
    assert not engine.speculator.proposer.kv.tables  # every followed sequence ended: the draft's blocks are free


def test_draft_model_kv_comes_out_of_the_same_budget(llama_checkpoint, tmp_path):
    """One byte budget sizes both pools: a block pays for the target's and the draft's K/V of its tokens, and
    the two pools together fit in it."""
    draft = build_checkpoint("qwen2", tmp_path).path
    budget = 1 << 20
    plain = make_engine(llama_checkpoint.path, num_device_blocks=None, kv_cache_memory_bytes=budget,
                        max_model_len=256)
    engine = make_engine(llama_checkpoint.path, num_device_blocks=None, kv_cache_memory_bytes=budget,
                         max_model_len=256, speculative_method="draft", speculative_model=draft)
    target_bytes, draft_bytes = engine.config.kv_bytes_per_token, engine.config.draft_kv_bytes_per_token
    assert target_bytes == plain.config.kv_bytes_per_token and draft_bytes > 0
    num_blocks = engine.config.scheduler.num_device_blocks
    assert num_blocks == budget // ((target_bytes + draft_bytes) * 16) < plain.config.scheduler.num_device_blocks
    proposer = engine.speculator.proposer
    assert proposer.kv.num_blocks == proposer.config.scheduler.num_device_blocks == num_blocks
    pools = [pool for runner in (engine.runner, proposer.runner) for pool, _ in runner.pools]
    assert sum(t.numel() * t.element_size() for t in pools) <= budget


def test_a_missing_draft_checkpoint_fails_before_the_target_loads(llama_checkpoint, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("engine.distributed.executor.load_model", no_load)
    with pytest.raises(FileNotFoundError, match="/nonexistent/draft"):
        make_engine(llama_checkpoint.path, speculative_method="draft", speculative_model="/nonexistent/draft")


def test_draft_model_caches_prefixes_per_tenant(llama_checkpoint):
    """The draft's pool caches full blocks under the requests' salts: a later request with the same prompt
    prefix and salt is caught up from them, another tenant's is not."""
    prefix = [(7 * i) % (VOCAB - 1) + 1 for i in range(40)]
    engine = make_engine(llama_checkpoint.path, speculative_method="draft", speculative_model=llama_checkpoint.path,
                         num_speculative_tokens=3)
    proposer = engine.speculator.proposer
    for i, salt in enumerate(["tenant-a", "tenant-a", "tenant-b"]):
        hits = proposer.kv.prefix_cache_hits
        engine.add_request(str(i), prefix + [i + 1], SamplingParams(temperature=0.0, max_tokens=8), cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        assert proposer.kv.prefix_cache_hits - hits == (32 if i == 1 else 0)  # 2 full blocks of 16
    engine.step()  # the next proposing stage drops what the draft kept for the ended sequences
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks


def test_draft_model_holds_blocks_of_running_sequences_only(llama_checkpoint):
    """A preempted sequence's draft blocks are freed before the next proposal (memory is short), and it is caught
    up again when it runs: outputs stay the non-speculative ones."""
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=24)) for p in mixed_prompts(8)]
    expected = run(make_engine(llama_checkpoint.path, num_device_blocks=14), reqs)
    engine = make_engine(llama_checkpoint.path, num_device_blocks=14, speculative_method="draft",
                         speculative_model=llama_checkpoint.path, num_speculative_tokens=3)
    for i, (prompt, params) in enumerate(reqs):
        engine.add_request(str(i), prompt, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        running = {seq.seq_id for group in engine.scheduler.running.values() for seq in group.seqs}
        engine.speculator.proposer.release_inactive()  # what the next step's proposing stage does first
        assert set(engine.speculator.proposer.kv.tables) <= running
    assert got == {rid: choices[0][0] for rid, choices in expected.items()}
    stats = engine.stats()
    assert stats.num_preemptions_total > 0 and stats.spec_decode_num_accepted_tokens_total > 0


def test_requests_that_opt_out_get_no_proposals(llama_checkpoint):
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=20, use_speculation=False)) for p in mixed_prompts(4)]
    expected = run(make_engine(llama_checkpoint.path), reqs)
    engine = make_engine(llama_checkpoint.path, speculative_method="ngram")
    engine.speculator.proposer = OracleProposer(collect(make_engine(llama_checkpoint.path), reqs))
    assert_same(run(engine, reqs), expected)
    assert engine.stats().spec_decode_num_drafts_total == 0


def test_ngram_lookup_takes_the_longest_latest_match():
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 3) == [4, 5, 1]
    assert lookup([1, 2, 3, 4, 9, 7, 3], 3, 2, 3) == []  # only a 1-gram matches
    assert lookup([256, 1, 0, 0, 0, 256, 1], 3, 1, 2) == [0, 0, 0]  # no match across token boundaries
    assert lookup([5, 5, 5, 5, 5, 5, 5], 3, 1, 2) == [5, 5, 5]  # an occurrence that k tokens follow first
    assert lookup([1, 2], 3, 1, 2) == []


# -- the rejection rule keeps the target's distribution ---------------------------------------------------------
TINY_VOCAB = 4


class FixedProposer:
    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, seqs: list[Sequence], ks: list[int], salts: list[bytes | None]) -> list[list[int]]:
        return [self.drafts[:k] for k in ks]

    def release_inactive(self) -> None:
        """Keeps nothing per sequence."""


@torch.inference_mode()
def _joint_probs(model, prompt: list[int], temperature: float, length: int) -> torch.Tensor:
    """p(t1, ..., t_length | prompt) over the tiny vocabulary, from transformers, flattened."""
    joint = torch.ones(1, dtype=torch.float64)
    prefixes: list[list[int]] = [[]]
    for _ in range(length):
        rows = torch.stack([(model(torch.tensor([prompt + p])).logits[0, -1].double() / temperature).softmax(-1)
                            for p in prefixes])
        joint = (joint.unsqueeze(1) * rows).flatten()
        prefixes = [p + [t] for p in prefixes for t in range(TINY_VOCAB)]
    return joint


@pytest.mark.parametrize("backend", backends()[1:])  # the compiled attention: the torch one loops per sequence
def test_sampled_tokens_follow_the_target_distribution(tmp_path, backend):
    """Unseeded draws with a fixed proposal of two tokens (verified after the first token, which the prefill
    samples): the joint frequencies of the first three tokens match transformers' (chi-square), and proposals
    were both accepted and rejected."""
    config = transformers.LlamaConfig(**(COMMON | dict(vocab_size=TINY_VOCAB, initializer_range=0.05)),
                                      num_key_value_heads=1, intermediate_size=256, tie_word_embeddings=False)
    checkpoint = build_checkpoint("llama", tmp_path, config=config)
    prompt, temperature, draws = [1, 3, 2], 0.9, 4000
    expected = _joint_probs(checkpoint.hf_model, prompt, temperature, 3) * draws
    engine = make_engine(checkpoint.path, speculative_method="ngram", num_speculative_tokens=2, max_num_seqs=256,
                         num_device_blocks=600, seed=123, attention_backend=backend)
    engine.speculator.proposer = FixedProposer([2, 1])
    outputs = run(engine, [(prompt, SamplingParams(temperature=temperature, max_tokens=4))] * draws)
    observed = torch.zeros(TINY_VOCAB ** 3, dtype=torch.float64)
    for (tokens, _, _, _), in outputs.values():
        observed[(tokens[0] * TINY_VOCAB + tokens[1]) * TINY_VOCAB + tokens[2]] += 1
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    keep = expected >= 5  # the rare outcomes pooled into one bin
    observed = torch.cat([observed[keep], observed[~keep].sum(0, keepdim=True)])
    expected = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


def test_cli_flags_configure_speculation():
    from service.cli import build_parser, worker_config

    args = build_parser().parse_args(["worker", "--speculative-method", "draft", "--speculative-model", "/d",
                                      "--num-speculative-tokens", "3", "--ngram-prompt-lookup-max", "5"])
    spec = worker_config(args).engine.speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("draft", "/d", 3, 5)
    assert EngineConfig().speculative_config is None
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(speculative_method="ngram", speculative_model="/d")
