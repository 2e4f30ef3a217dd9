"""Decode steps padded to DecodeGraphs' buckets: the buckets, the padded static inputs, and greedy outputs
token-exact with transformers through the padded path (on CPU: the same buffers a CUDA graph replays, run
eagerly), with prefill/decode mixes falling back to the eager path."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, decode_buckets
from engine.layers.attention import AttentionMetadata
from engine.step_inputs import StepBuffers, StepLayout, StepTensors

from .conftest import TEST_DEVICE, backends, hf_greedy, mixed_prompts


def test_buckets_follow_the_steps_up_to_max_num_seqs():
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, *range(80, 257, 16)]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(1) == [1]


def test_bucket_is_the_smallest_that_holds_the_batch():
    graphs = DecodeGraphs(torch.nn.Identity(), 20, 4, 64, torch.device("cpu"))
    assert graphs.buckets == [1, 2, 4, 8, 16, 20]
    assert [graphs.bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 20, 21)] == [1, 2, 4, 8, 8, 16, 20, 20, None]
    assert graphs.accepts(20, 1, 4)
    assert not graphs.accepts(3, 2, 1)  # a prefill chunk in the step
    assert not graphs.accepts(21, 1, 1)  # past the largest bucket
    assert not graphs.accepts(3, 1, 5)  # tables wider than the static ones


def test_padding_stores_nowhere_and_attends_one_key():
    """Two decoding seqs padded to 4: the pads' fields written out by hand."""
    meta = AttentionMetadata(torch.tensor([37, 50]), torch.tensor([[2, 3], [3, 0]], dtype=torch.int32),
                             torch.tensor([22, 19], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
                             1, 22)
    step = StepTensors(torch.tensor([7, 9]), torch.tensor([21, 18]), meta, torch.tensor([0, 1]))
    buffers = StepBuffers(torch.device("cpu"))
    out = buffers.load(StepLayout(4, 4, 3, 2), step)
    m = out.meta
    assert out.input_ids.tolist() == [7, 9, 0, 0] and out.positions.tolist() == [21, 18, 0, 0]
    assert m.slot_mapping.tolist() == [37, 50, -1, -1]
    assert m.seq_lens.tolist() == [22, 19, 1, 1] and m.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert m.block_tables[:, :2].tolist() == [[2, 3], [3, 0], [0, 0], [0, 0]]
    assert m.block_tables[2:, 2].tolist() == [0, 0]
    assert out.sample_rows.tolist() == [0, 1] and (m.max_query_len, m.max_seq_len) == (1, 22)
    # A smaller step reuses the buffer: its pads overwrite the previous step's rows.
    small = StepTensors(step.input_ids[:1], step.positions[:1], AttentionMetadata(
        meta.slot_mapping[:1], meta.block_tables[:1], meta.seq_lens[:1], meta.query_start_loc[:2], 1, 22),
        step.sample_rows[:1])
    again = buffers.load(StepLayout(2, 2, 3, 1), small)
    assert again.meta.slot_mapping.tolist() == [37, -1] and again.meta.seq_lens.tolist() == [22, 1]
    with pytest.raises(ValueError, match="does not fit"):
        buffers.load(StepLayout(3, 4, 3, 2), step)  # 1 pad token for 2 pad seqs


def _padded_llm(path: str, backend: str, **overrides) -> tuple[LLM, list[int]]:
    """An LLM whose decode steps go through DecodeGraphs; also the batch sizes those steps had."""
    config = dict(attention_backend=backend, dtype="float32", num_device_blocks=256, show_progress=False,
                  max_num_seqs=20, device=TEST_DEVICE)
    llm = LLM(path, skip_tokenizer_init=True, **(config | overrides))
    runner = llm.engine.runner
    # CPU: eager unless asked; CUDA: graphs with the compiled kernels.
    on_by_default = TEST_DEVICE == "cuda" and backend == "ext"
    assert llm.engine.config.decode_graphs == on_by_default and (runner.graphs is None) != on_by_default
    if not on_by_default:
        runner.enable_decode_graphs()
    graphs, sizes = runner.graphs, []
    forward = graphs.forward

    def counted(step, fill=None):
        sizes.append(len(step.meta.seq_lens))
        return forward(step, fill)
    graphs.forward = counted
    return llm, sizes


@pytest.mark.parametrize("backend", backends())
def test_padded_decode_matches_hf(llama_checkpoint, backend):
    """Seqs of different lengths finish one after another, so the batch passes through sizes between buckets."""
    llm, sizes = _padded_llm(llama_checkpoint.path, backend)
    prompts = mixed_prompts(13, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True) for i in range(len(prompts))]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    expected = [hf_greedy(llama_checkpoint.hf_model, p, 4 + i) for i, p in enumerate(prompts)]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    between = {n for n in sizes if n not in llm.engine.runner.graphs.buckets}
    assert {3, 5, 13} <= set(sizes) and between  # sizes padded up, not only exact buckets


@pytest.mark.parametrize("backend", backends())
def test_prefill_mixes_fall_back_to_eager(llama_checkpoint, backend):
    """Chunked prefills of staggered requests share steps with decodes: those run eagerly, the rest padded."""
    llm, sizes = _padded_llm(llama_checkpoint.path, backend, max_num_batched_tokens=16, max_num_seqs=8)
    engine, prompts = llm.engine, mixed_prompts(8, seed=2)
    steps, eager = 0, 0
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        before = len(sizes)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        steps, eager = steps + 1, eager + (len(sizes) == before)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert eager and sizes  # both paths ran
    assert [outputs[str(i)] for i in range(len(prompts))] == [
        hf_greedy(llama_checkpoint.hf_model, p, 10) for p in prompts]


def test_a_bucket_reads_the_addresses_its_steps_are_loaded_at():
    """A captured graph keeps the addresses of its bucket's static inputs: every later step of that bucket must
    be loaded at those same addresses, whatever its number of sampled rows."""
    graphs = DecodeGraphs(torch.nn.Identity(), 20, 4, 64, torch.device("cpu"))
    captured = graphs.inputs.views(StepLayout(8, 8, 4, 0), 1, 64)
    meta = AttentionMetadata(torch.arange(5), torch.zeros(5, 2, dtype=torch.int32),
                             torch.full((5,), 3, dtype=torch.int32), torch.arange(6, dtype=torch.int32), 1, 3)
    loaded = graphs.inputs.load(StepLayout(8, 8, 4, 3), StepTensors(torch.arange(5), torch.arange(5), meta,
                                                                    torch.tensor([0, 2, 4])))
    assert _addresses(captured) == _addresses(loaded)
    assert captured.meta.seq_lens.tolist() == [3] * 5 + [1] * 3  # the same memory, so the same values


def _addresses(step: StepTensors) -> list[tuple[int, torch.Size]]:
    m = step.meta
    tensors = (step.input_ids, step.positions, m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc)
    return [(t.data_ptr(), t.shape) for t in tensors]
