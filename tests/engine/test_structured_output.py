"""Constrained decoding (xgrammar) and logit_bias, end to end on a random-weight model: every output is checked
by an independent reference (jsonschema, re.fullmatch, json.loads)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models

from engine import LLM, SamplingParams
from engine.sampler import Sampler
from engine.sequence import Sequence
from engine.structured_output import StructuredOutputParams, check_structured_output

from .conftest import COMMON, build_checkpoint

pytestmark = pytest.mark.timeout(60)

EOS = 299
# A character tokenizer (printable ASCII) plus a few multi-character pieces and fillers; the last id is EOS.
PIECES = [chr(c) for c in range(32, 127)] + ['{"', '":', '",', '"}', "true", "false", "null", "  ", "ab"]
VOCAB = PIECES + [f"<x{i}>" for i in range(EOS - len(PIECES))] + ["</s>"]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("grammar")
    config = transformers.LlamaConfig(**{**COMMON, "eos_token_id": EOS}, num_key_value_heads=1,
                                      intermediate_size=256, tie_word_embeddings=False)
    build_checkpoint("llama", folder, config=config)
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(VOCAB)}, unk_token="</s>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", params=["torch", "ext"])
def llm(path, request) -> LLM:
    """Both backends: the reference's mask ops and the compiled ones (masked_row_argmax, apply_token_bitmask)."""
    return LLM(path, skip_tokenizer_init=True, attention_backend=request.param, dtype="float32",
               num_device_blocks=256, show_progress=False)


def text(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids if i != EOS)


def run(llm: LLM, so: dict | None, n: int = 1, prompts=((1, 2, 3),), **kw) -> list:
    params = SamplingParams(n=n, max_tokens=kw.pop("max_tokens", 60), structured_output=so, **kw)
    return llm.generate(prompt_token_ids=[list(p) for p in prompts], sampling_params=params, use_tqdm=False)


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 5},  # xgrammar ignores maxLength next to a pattern
    "code": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "kind": {"enum": ["cat", "dog"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
    "pos": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x"]}},
    "required": ["name", "code", "age", "kind", "tags", "pos"], "additionalProperties": False}


def test_json_schema_outputs_validate(llm):
    for out in run(llm, {"json": json.dumps(SCHEMA)}, n=2, temperature=1.0, seed=1, max_tokens=120):
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, text(c.token_ids))
            jsonschema.validate(json.loads(text(c.token_ids)), SCHEMA)


@pytest.mark.parametrize("so, check", [
    ({"regex": r"[a-c]{2,4}-\d{1,3}"}, lambda s: re.fullmatch(r"[a-c]{2,4}-\d{1,3}", s)),
    ({"choice": ["yes", "no", "maybe"]}, lambda s: s in ("yes", "no", "maybe")),
    ({"grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'}, lambda s: re.fullmatch(r"\(\d+(\+\d+)*\)", s)),
    ({"json_object": True}, lambda s: isinstance(json.loads(s), dict)),
])
def test_other_kinds(llm, so, check):
    for temperature in (0.0, 1.0):
        c = run(llm, so, temperature=temperature, seed=3)[0].outputs[0]
        assert c.finish_reason in ("stop", "length") and (c.finish_reason == "length" or check(text(c.token_ids)))


def test_n4_seeded_is_reproducible_and_valid(llm):
    so = {"regex": r"[a-z]{3}[0-9]{2}"}
    first, second = (run(llm, so, n=4, temperature=1.0, seed=7)[0].outputs for _ in range(2))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert all(re.fullmatch(r"[a-z]{3}[0-9]{2}", text(c.token_ids)) for c in first)


def test_unconstrained_batch_mate_unchanged(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    solo = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=plain, use_tqdm=False)[0]
    both = llm.generate(prompt_token_ids=[[5, 6, 7], [1, 2, 3]], use_tqdm=False, sampling_params=[
        plain, SamplingParams(temperature=0.0, max_tokens=12, structured_output={"regex": "[0-9]+"})])
    assert both[0].outputs[0].token_ids == solo.outputs[0].token_ids
    assert re.fullmatch("[0-9]+", text(both[1].outputs[0].token_ids))


def test_bad_specs_rejected():
    for so in ({"regex": "[a-"}, {"json": "{"}, {"json": '{"type": "nope"}'}, {"grammar": "root ::= "}):
        with pytest.raises(ValueError):
            check_structured_output(StructuredOutputParams.from_wire(so), 10_000)
    with pytest.raises(ValueError):
        check_structured_output(StructuredOutputParams(regex="a" * 100), 10)
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"unknown": 1}):
        with pytest.raises(ValueError):
            StructuredOutputParams.from_wire(bad)
    assert StructuredOutputParams.from_wire({"choice": ["a"]}).to_wire() == {"choice": ["a"]}
    with pytest.raises(ValueError):
        SamplingParams(n=2, use_beam_search=True, structured_output={"regex": "a"})
    with pytest.raises(ValueError):
        SamplingParams(n=2, use_beam_search=True, logit_bias={1: 1.0})


def test_grammar_memory_limit_fails_only_that_request(path):
    engine = LLM(path, skip_tokenizer_init=True, attention_backend="torch", dtype="float32", num_device_blocks=64,
                 show_progress=False, max_grammar_bytes=1).engine
    engine.add_request("big", [1, 2], SamplingParams(max_tokens=4, structured_output={"regex": "[a-z]+"}))
    engine.add_request("plain", [3, 4], SamplingParams(max_tokens=4))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert "max_grammar_bytes" in outs["big"][-1].error and outs["big"][-1].finished
    assert sum(len(o.outputs[0].token_ids) for o in outs["plain"] if o.outputs) == 4
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


# ---- logit_bias ----------------------------------------------------------------
def test_logit_bias_matches_hand_reference():
    sampler = Sampler(eos_token_ids=set(), seed=0)
    seq = Sequence([0], 1)
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    greedy = dict(temperature=0.0, logprobs=1)
    forced = sampler(logits, [seq], [SamplingParams(logit_bias={0: 100.0}, **greedy)])
    assert forced.token_ids == [0]
    assert forced.logprobs[0][0][1] == pytest.approx(logits.log_softmax(-1)[0, 0].item())  # raw logprobs
    assert sampler(logits, [seq], [SamplingParams(logit_bias=[[1, -100]], **greedy)]).token_ids == [2]
    want = (logits + torch.tensor([[0.0, -1.5, 0.0, 2.5]])).argmax().item()
    assert sampler(logits, [seq], [SamplingParams(logit_bias={1: -1.5, 3: 2.5}, **greedy)]).token_ids == [want]
    for bad in ({1: 101}, {-1: 1}, {i: 1 for i in range(1025)}):
        with pytest.raises(ValueError):
            SamplingParams(logit_bias=bad)


def test_logit_bias_end_to_end(llm):
    out = run(llm, None, temperature=1.0, seed=0, max_tokens=5, logit_bias={42: 100})[0].outputs[0]
    assert out.token_ids == [42] * 5
    with pytest.raises(ValueError):
        run(llm, None, logit_bias={300: 1})


# ---- grammar state across preemption, resume, chunked prefill ------------------
REGEX = r"[a-z]{4}-[0-9]{3}-[a-z ]{20,30}"
PROMPTS = [[1 + i, 2, 3, 4 + i] for i in range(4)]


def constrained_tokens(path: str, **config) -> tuple[list[list[int]], object]:
    llm = LLM(path, skip_tokenizer_init=True, attention_backend="torch", dtype="float32", show_progress=False,
              block_size=8, **{"num_device_blocks": 256} | config)
    outs = run(llm, {"regex": REGEX}, n=2, prompts=PROMPTS, temperature=1.0, seed=11, max_tokens=50)
    return [c.token_ids for o in outs for c in o.outputs], llm.engine.stats()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_grammar_state(path, mode):
    reference, _ = constrained_tokens(path)
    assert all(re.fullmatch(REGEX, text(t)) for t in reference)
    extra = dict(num_cpu_blocks=64) if mode == "swap" else {}
    got, stats = constrained_tokens(path, num_device_blocks=12, preemption_mode=mode, **extra)
    assert stats.num_preemptions_total > 0 and got == reference
    assert (stats.num_swapped_out_blocks_total > 0) == (mode == "swap")
    assert stats.grammar_mask_steps_total > 0 and stats.grammar_mask_seconds_total > 0


def test_chunked_prefill_and_prefix_hit(path):
    llm = LLM(path, skip_tokenizer_init=True, attention_backend="torch", dtype="float32", show_progress=False,
              num_device_blocks=64, max_num_batched_tokens=16)
    prompt = list(range(1, 60))
    first, again = (run(llm, {"regex": "[0-9]{5}"}, prompts=[prompt], temperature=0.0)[0] for _ in range(2))
    assert again.num_cached_tokens > 0 and first.outputs[0].token_ids == again.outputs[0].token_ids
    assert re.fullmatch("[0-9]{5}", text(first.outputs[0].token_ids))


def test_resume_rebuilds_matcher_from_delivered_tokens(llm):
    from engine.outputs import ResumeState

    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=50, structured_output={"regex": REGEX})
    full = [c.token_ids for c in llm.generate(prompt_token_ids=[[9, 8, 7]], sampling_params=params,
                                              use_tqdm=False)[0].outputs]
    engine = llm.engine
    engine.add_request("r", [9, 8, 7], params, resume=ResumeState([full[0][:6], full[1][:9]], [None, None]))
    got = {0: list(full[0][:6]), 1: list(full[1][:9])}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                got[c.index] += c.token_ids
    assert [got[0], got[1]] == full


def test_no_allowed_token_ends_the_choice_with_error(llm):
    # After "ab" the grammar allows only EOS, which min_tokens bans: nothing is left to draw.
    c = run(llm, {"regex": "ab"}, temperature=0.0, min_tokens=5, max_tokens=8)[0].outputs[0]
    assert c.finish_reason == "error" and text(c.token_ids).startswith("ab")


def test_engine_rejects_bad_spec_and_keeps_serving(llm):
    with pytest.raises(ValueError, match="regex"):
        llm.engine.add_request("bad", [1, 2], SamplingParams(structured_output={"regex": "(unclosed"}))
    assert run(llm, {"choice": ["a", "b"]}, temperature=0.0)[0].outputs[0].finish_reason == "stop"


def test_sampler_masks_greedy_and_sampled_rows_alike_on_both_backends():
    """Rows 0 and 2 constrained (one greedy, one sampled, seeded), row 1 free: the compiled ops give the
    reference's tokens, every constrained token is allowed, and the logprobs stay the raw model's."""
    import cuda_ext
    from engine.core.scheduler_output import TokenMask

    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    allowed = [[3, 50, 77], None, [9, 10, 11, 12, 99]]
    bitmask = torch.zeros(2, 4, dtype=torch.int32)
    for i, ids in enumerate(a for a in allowed if a):
        for t in ids:
            bitmask[i, t // 32] |= 1 << (t % 32)  # bit 31 wraps to the sign bit, as in xgrammar's int32 words
    mask = TokenMask([0, 2], bitmask)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=5)]
    seqs = [Sequence([1, 2], 2, index=i) for i in range(3)]
    outs = [Sampler(set(), 0, ops=cuda_ext.load_ops(b))(logits, seqs, params, mask=mask) for b in ("torch", "ext")]
    assert outs[0].token_ids == outs[1].token_ids
    tokens = outs[0].token_ids
    assert tokens[0] == max(allowed[0], key=lambda t: logits[0, t]) and tokens[2] in allowed[2]
    assert tokens[1] == logits[1].argmax()
    assert outs[0].logprobs[0][0] == (tokens[0], pytest.approx(logits[0].log_softmax(-1)[tokens[0]].item()))


def test_bounded_strings_refuse_control_characters():
    """A bare maxLength string must not admit raw control characters (xgrammar's own rule does)."""
    import xgrammar as xgr

    from engine.structured_output import build_grammar

    vocab = ['"', "a", "\x01", "\n", "</s>"]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[4]))
    schema = {"type": "string", "minLength": 1, "maxLength": 2, "default": {"type": "string", "maxLength": 1}}
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(build_grammar("json", json.dumps(schema))))
    assert matcher.accept_token(0)
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    matcher.fill_next_token_bitmask(bitmask)
    allowed = [v for i, v in enumerate(vocab) if (int(bitmask[0, 0]) >> i) & 1]
    assert allowed == ["a"]  # not '"' either: minLength 1
    for token in (1, 1, 0):
        assert matcher.accept_token(token)
    assert matcher.is_terminated() or matcher.accept_token(4)
