"""Tensor parallelism on CPU (tp = 2, gloo, one thread per rank): greedy output token-exact with transformers
and with tp = 1, through preemption (recompute and swap), prefix-cache hits, chunked prefill and n > 1; the
plan's wire format; shapes that do not divide; a rank killed mid-generation ends the engine."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams
from engine.core.scheduler import Scheduler
from engine.distributed.parallel_state import TensorParallel
from engine.distributed.plan import _decode, _encode
from engine.layers.attention import AttentionMetadata
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear, Shard
from engine.layers.vocab_parallel import ParallelLMHead
from engine.model_runner import Batch, StepPlan
from engine.models.config import read_model_config
from engine.models.moe import FusedExperts
from .conftest import ARCH_CONFIGS, MAX_NEW_TOKENS, VOCAB, build_checkpoint, hf_greedy, mixed_prompts, _ext_available

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
PROMPTS = mixed_prompts(count=8)
# Scheduler overrides per scenario. 8 prompts of up to 70 tokens + 20 new ones need ~35 blocks of 16 at once,
# so 12 blocks force preemption.
SCENARIOS = {
    "plain": dict(enable_prefix_caching=False),
    "recompute": dict(num_device_blocks=12, preemption_mode="recompute", enable_prefix_caching=False),
    "swap": dict(num_device_blocks=12, num_cpu_blocks=12, preemption_mode="swap", enable_prefix_caching=False),
    "prefix": dict(enable_prefix_caching=True),
    "chunked": dict(max_num_batched_tokens=16, enable_chunked_prefill=True, enable_prefix_caching=False),
}
ENGINE = dict(dtype="float32", num_device_blocks=64, num_cpu_blocks=16, num_threads=1, show_progress=False,
              attention_backend="ext" if _ext_available() else "torch")


# ARCH_CONFIGS entries run at tp=2 (the README's model table reads it).
TP_ARCHS = ["llama", "qwen2", "qwen3", "opt", "phi3", "gemma2", "gemma3", "gemma4", "gemma4-moe", "mixtral", "qwen2-moe",
            "qwen3-moe", "gpt-oss", "deepseek-v3", "qwen3-next", "qwen3.5"]


@pytest.fixture(scope="module", params=TP_ARCHS)
def model(request, tmp_path_factory):
    """(checkpoint, transformers' greedy outputs, a tp=2 LLM): one engine and worker per model, shared by the
    scenarios (each runs on a fresh scheduler over the same KV pools; the ranks never see the scheduler).
    OPT gets an odd vocabulary, so its embedding and LM head are padded (tied, too). Phi-3 stores q|k|v and
    gate|up fused: each rank reads its slice of each part (KV replicated). MoE experts are sharded by their
    intermediate size, so an expert count that does not divide the ranks runs (Qwen2-MoE's 5 here)."""
    config = ARCH_CONFIGS[request.param]()
    if request.param == "opt":
        config.vocab_size = VOCAB + 1
    if request.param in ("phi3", "mixtral"):  # windows would free blocks as they slide: the scenarios' pools must fill
        config.sliding_window = None
    if request.param == "qwen2-moe":
        config.num_experts = 5
    checkpoint = build_checkpoint(request.param, tmp_path_factory.mktemp(f"tp-{request.param}"), config=config)
    reference = [hf_greedy(checkpoint.hf_model, p, MAX_NEW_TOKENS) for p in PROMPTS]
    llm = LLM(checkpoint.path, skip_tokenizer_init=True, tensor_parallel_size=2, **ENGINE)
    yield checkpoint, reference, llm
    llm.engine.runner.shutdown()
    assert all(w.exitcode == 0 for w in llm.engine.runner.workers)  # they left their loop when told


def use_scheduler(llm: LLM, **overrides) -> None:
    engine = llm.engine
    engine.scheduler = Scheduler(replace(engine.config.scheduler, **overrides), engine.eos_token_ids,
                                 engine.scheduler.grammar)


def generate(llm: LLM, params: SamplingParams = GREEDY) -> list[list[list[int]]]:
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    assert all(o.finished and o.error is None for o in outputs)
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_model_is_sharded(model):
    checkpoint, _, llm = model
    runner, hf = llm.engine.runner.runner, checkpoint.hf_model.config
    attn = runner.model.attention_layers()[0]
    assert attn.num_heads == hf.num_attention_heads // 2
    # Fewer KV heads than ranks (llama, qwen2): each rank keeps one, replicated; the pool holds only its heads.
    # Layer 0's KV heads, as config.json gives them (Gemma 4's global layers have their own).
    assert attn.num_kv_heads == max(1, read_model_config(checkpoint.path).kv_layers()[0].num_kv_heads // 2)
    assert runner.pools[0][0].shape[3] == attn.num_kv_heads
    assert runner.model.lm_head.weight.shape[0] == -(-hf.vocab_size // 2)  # padded to a multiple of the ranks
    experts = [m for m in runner.model.modules() if isinstance(m, FusedExperts)]
    for e in experts:  # every expert on every rank, half of each one's intermediate size
        intermediate = getattr(hf, "moe_intermediate_size", hf.intermediate_size)
        assert e.w13.shape == (e.w2.shape[0], intermediate, hf.hidden_size)
        assert e.w2.shape[1:] == (hf.hidden_size, intermediate // 2)
    moe = any(kind in hf.architectures[0] for kind in ("Moe", "Mixtral", "GptOss", "Deepseek", "Next"))
    assert bool(experts) == (moe or getattr(hf, "enable_moe_block", False))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_matches_hf(model, scenario):
    _, reference, llm = model
    use_scheduler(llm, **SCENARIOS[scenario])
    assert generate(llm) == [[r] for r in reference]
    stats = llm.engine.stats()
    if scenario == "recompute":
        assert stats.num_preemptions_total > 0
    if scenario == "swap":
        assert stats.num_swapped_out_blocks_total > 0 and stats.num_swapped_in_blocks_total > 0
    if scenario == "prefix":  # the second pass finds every prompt's full blocks cached
        assert generate(llm) == [[r] for r in reference]
        assert llm.engine.stats().prefix_cache_hits_total > 0
    assert stats.num_blocks_free == stats.num_blocks_total


def test_matches_tp1_with_forks(model):
    """n = 2 forks every prompt (shared blocks, copy-on-write copies in the plan); tp = 1 gives the same."""
    checkpoint, reference, llm = model
    use_scheduler(llm, enable_prefix_caching=True)
    params = replace(GREEDY, n=2)
    tp2 = generate(llm, params)
    assert tp2 == [[r, r] for r in reference]
    tp1 = LLM(checkpoint.path, skip_tokenizer_init=True, **ENGINE)
    assert generate(tp1, params) == tp2


def test_beam_search_matches_tp1(model):
    """Beam search forks and frees candidates every step (copy-on-write copies in each plan): tp = 2 returns
    the same hypotheses, in the same order, as tp = 1 (which tests/engine/test_beam_search.py holds to
    transformers)."""
    checkpoint, _, llm = model
    use_scheduler(llm, enable_prefix_caching=True)
    params = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)
    tp1 = LLM(checkpoint.path, skip_tokenizer_init=True, **ENGINE)
    expected = [[s.token_ids for s in o.sequences] for o in tp1.beam_search(PROMPTS[:3], params)]
    assert [[s.token_ids for s in o.sequences] for o in llm.beam_search(PROMPTS[:3], params)] == expected
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.config.scheduler.num_device_blocks


def test_structured_output_matches_tp1(model):
    """The grammar lives on rank 0 with the sampler: constrained greedy and seeded n = 2 draws under tp = 2
    are tp = 1's, and every one fits the regex."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    checkpoint, _, llm = model
    vocab = [chr(c) for c in range(33, 127)]
    vocab += [f"<x{i}>" for i in range(llm.engine.config.model_config.vocab_size - len(vocab))]
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<x0>"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(checkpoint.path)  # read on first use
    use_scheduler(llm, enable_prefix_caching=True)
    pattern = "[a-c][0-9a-f]{30}"
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_output={"regex": pattern}),
              SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12, structured_output={"regex": pattern})]
    tp1 = LLM(checkpoint.path, skip_tokenizer_init=True, **ENGINE)
    for p in params:
        tp2 = generate(llm, p)
        assert generate(tp1, p) == tp2
        for choices in tp2:
            for tokens in choices:
                assert re.fullmatch("[a-c][0-9a-f]{11}", "".join(vocab[t] for t in tokens))


def test_step_timers_see_rank_0(model):
    """bench_offline's per-step breakdown works on a tensor-parallel engine (rank 0's runner is timed)."""
    from loadtest.profile_step import instrument

    _, reference, llm = model
    use_scheduler(llm, enable_prefix_caching=False)
    timers = instrument(llm.engine)
    assert generate(llm) == [[r] for r in reference]
    ms = timers.breakdown()
    assert timers.steps > 0 and ms["gemm"] > 0 and ms["attention"] > 0 and ms["prepare"] > 0


def test_shard_arithmetic():
    """Which slice of each checkpoint tensor a rank reads, without processes (4 ranks, 2 KV heads of 64)."""
    tp = TensorParallel(rank=3, size=4)
    qkv = ColumnParallelLinear(128, [4 * 64, 2 * 64, 2 * 64], False, tp, [4, 2, 2])
    assert qkv.weight.shape == (3 * 64, 128)
    assert qkv.checkpoint_shard("weight", 0) == Shard(0, 256, 3 * 64, 64, 0)  # query head 3
    assert qkv.checkpoint_shard("weight", 2) == Shard(0, 128, 64, 64, 128)  # ranks 2, 3 share KV head 1
    down = RowParallelLinear(256, 128, True, tp)
    assert down.checkpoint_shard("weight", None) == Shard(1, 256, 192, 64) and down.checkpoint_shard("bias", None) is None
    head = ParallelLMHead(128, 301, tp)  # 76 rows per rank; the last rank has 73 real ones
    assert head.weight.shape == (76, 128) and head.checkpoint_shard("weight", None) == Shard(0, 301, 228, 73)
    with pytest.raises(ValueError, match="neither a divisor nor a multiple of num_key_value_heads=3"):
        tp.kv_heads(3)
    experts = FusedExperts(4, 128, 256, "moe_intermediate_size", tp)  # every expert, a quarter of each
    assert experts.w13.shape == (4, 2 * 64, 128) and experts.w2.shape == (4, 128, 64)
    assert experts.checkpoint_shard("w13", (2, 1)) == Shard(0, 256, 192, 64, 64, select=2)  # expert 2's up rows
    assert experts.checkpoint_shard("w2", (1, 0)) == Shard(1, 256, 192, 64, select=1)


def test_plan_round_trip():
    tables = torch.tensor([[3, 4, 0], [7, 8, 9]], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor([50, 51, 130]), tables, torch.tensor([2, 35], dtype=torch.int32),
                             torch.tensor([0, 2, 3], dtype=torch.int32), 2, 35)
    batch = Batch(torch.tensor([11, 12, 13]), torch.tensor([0, 1, 34]), meta, torch.tensor([1, 2]))
    plan = StepPlan(torch.tensor([[1, 0]]), torch.zeros(0, 2, dtype=torch.int64), torch.tensor([[2, 5], [6, 7]]),
                    batch)
    header, payload = _encode(plan)
    got = _decode(header.tolist(), payload)
    for name in ("swap_out", "swap_in", "copies"):
        assert torch.equal(getattr(got, name), getattr(plan, name))
    for name in ("input_ids", "positions", "sample_rows"):
        assert torch.equal(getattr(got.batch, name), getattr(batch, name))
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        a, b = getattr(got.batch.meta, name), getattr(meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert (got.batch.meta.max_query_len, got.batch.meta.max_seq_len) == (2, 35)
    moves_only = _decode(*(lambda h, p: (h.tolist(), p))(*_encode(replace(plan, batch=None))))
    assert moves_only.batch is None and torch.equal(moves_only.copies, plan.copies)


def test_shapes_that_do_not_divide_fail_at_load(tmp_path):
    checkpoint = build_checkpoint("llama", tmp_path)  # 2 attention heads, 1 KV head
    with pytest.raises(ValueError, match="tensor_parallel_size=3: num_attention_heads=2 is not divisible by 3"):
        LLM(checkpoint.path, skip_tokenizer_init=True, tensor_parallel_size=3, **ENGINE)


@pytest.mark.parametrize("arch, field", [("mixtral", "intermediate_size"), ("qwen3-moe", "moe_intermediate_size"),
                                         ("gemma4-moe", "moe_intermediate_size")])
def test_expert_size_that_does_not_divide_fails_at_load(tmp_path, arch, field):
    config = ARCH_CONFIGS[arch]()
    setattr(config, field, 65)
    checkpoint = build_checkpoint(arch, tmp_path, config=config)
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2: {field}=65 is not divisible by 2"):
        LLM(checkpoint.path, skip_tokenizer_init=True, tensor_parallel_size=2, **ENGINE)


# Runs an engine in its own process: the test kills one of its ranks while it generates.
_KILLED_ENGINE = """
import sys
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32", num_device_blocks=64,
          num_threads=1, show_progress=False, attention_backend=sys.argv[2])
print("worker", llm.engine.runner.workers[0].pid, flush=True)
llm.generate(prompt_token_ids=[[1, 2, 3]], use_tqdm=False, sampling_params=SamplingParams(max_tokens=2))
print("generating", flush=True)
while True:
    llm.generate(prompt_token_ids=[[1, 2, 3]] * 4, use_tqdm=False,
                 sampling_params=SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
"""


def _start_tp_engine(tmp_path, stderr: int) -> subprocess.Popen:
    """A tp=2 engine generating forever in its own process; its first line names its worker's pid, its second
    once a first (short) generate call has run on both ranks."""
    checkpoint = build_checkpoint("llama", tmp_path)
    env = os.environ | {"PYTHONPATH": os.getcwd()}
    return subprocess.Popen([sys.executable, "-c", _KILLED_ENGINE, checkpoint.path, ENGINE["attention_backend"]],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)


def test_killed_rank_ends_the_engine(tmp_path):
    proc = _start_tp_engine(tmp_path, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()
        assert line.startswith("worker") and proc.stdout.readline() == "generating\n", proc.stderr.read()
        os.kill(int(line.split()[1]), signal.SIGKILL)
        # Within 30 s: the watchdog's doing (a collective with the dead rank would wait for its 5-minute timeout).
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    stderr = proc.stderr.read()
    assert code != 0, stderr
    assert "its tensor-parallel group is broken" in stderr, stderr


@pytest.mark.slow
def test_killed_engine_ends_its_workers(tmp_path):
    """The other way round: rank 0 killed (no chance to clean up), its worker notices and exits."""
    proc = _start_tp_engine(tmp_path, stderr=subprocess.DEVNULL)
    try:
        worker = int(proc.stdout.readline().split()[1])
        assert proc.stdout.readline() == "generating\n"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
