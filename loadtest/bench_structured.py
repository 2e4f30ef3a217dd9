"""Structured-output throughput: every request constrained by a JSON schema against the same requests unconstrained.

    python -m loadtest.bench_structured --json results/bench_structured.json [--num-requests 64] [--repeats 3]

Model: ``bench_offline``'s llama-19m (random weights, fp32, ``--threads`` 2) with a byte-level BPE tokenizer trained
here, in about a second, on the Python standard library's sources up to the model's 32000-token vocabulary: xgrammar
needs each token's string, and the per-step mask fill scales with the vocabulary, so the demo model's 512 tokens would
flatter it. EOS is the tokenizer's ``</s>``. Prompts are ``bench_offline``'s Alpaca-like random token ids, all
submitted at once (``--num-requests`` concurrent sequences, 64 by default), decoded greedily.

Equal work on both sides: a random model's JSON has no set length, so each repeat runs the constrained requests first
(capped at ``--max-tokens``; each ends when its grammar completes and EOS, the only token the grammar then allows, is
sampled) and then the same prompts unconstrained, each with ``max_tokens`` set to the length its constrained twin
produced and ``ignore_eos=True``. Both runs then generate the same number of tokens per request in the same number of
steps, so the throughput ratio (output tokens / wall time, unconstrained = 1) is the grammar's whole cost: the mask
fill, the bitmask applied to the logits (for greedy rows, ``masked_row_argmax`` over the allowed tokens), and the
sampler's full-logits path where greedy requests otherwise take the argmax shortcut. The unconstrained twins run twice
a round: on the engine's default path for greedy requests (the LM head's argmax alone, through its bf16 screen where
the CPU has AVX512-BF16) and on the full-logits path the constrained rows take (logits written, argmax fused into the
GEMM); which is faster depends on the host (the screen wins at a few rows, and can lose at 64), so the ratio is
against the faster, the baseline at its best. The modes alternate for ``--repeats`` rounds on one engine (after a
warm-up of each, which also compiles the schema) and each reports its median run. Every constrained output is decoded and checked with ``json.loads`` and
``jsonschema.validate``.

Also reported: the mask fill's seconds per step from ``EngineStats`` (the grammar counters' change over the median
constrained run), and the schema's compile time, timed cold (a new compiler, the tokenizer's vocabulary included).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sysconfig
import tempfile
import time
from dataclasses import dataclass

import jsonschema
import torch

from engine import LLM, SamplingParams
from engine.core.grammar import StructuredOutputManager
from engine.structured_output import StructuredOutputParams
from loadtest import output_path
from loadtest.bench_offline import MODELS, make_workload, pagedserve_config, timed, write_checkpoint

MODEL = "llama-19m"
VOCAB = MODELS[MODEL]["config"]["vocab_size"]
EOS = "</s>"
TARGET_RATIO = 0.85
MODES = ("constrained", "unconstrained", "unconstrained_full_logits")
# A record extraction: a bounded name, a bounded integer, an enum, a boolean and a bounded array of bounded strings.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][A-Za-z .'-]{0,23}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z0-9-]{1,12}$"},
                 "minItems": 1, "maxItems": 4},
    },
    "required": ["name", "age", "role", "active", "tags"],
    "additionalProperties": False,
}


def write_tokenizer(folder: str, vocab_size: int) -> int:
    """A byte-level BPE of ``vocab_size`` tokens trained on the standard library's sources; returns EOS's id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if tokenizer.get_vocab_size() != vocab_size:  # a smaller corpus than expected: xgrammar's vocabulary must match
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, the model has {vocab_size}")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(folder)
    return tokenizer.token_to_id(EOS)


def write_model(folder: str) -> str:
    eos = write_tokenizer(folder, VOCAB)
    return write_checkpoint(MODEL, folder, eos_token_id=eos)


@dataclass(slots=True)
class Run:
    """One timed generate call: its (wall, CPU) seconds, each request's output tokens and texts, finish reasons."""

    seconds: tuple[float, float]
    lengths: list[int]
    texts: list[str]
    finish_reasons: list[str | None]
    mask_fill: tuple[float, int] = (0.0, 0)  # the grammar counters' change: (seconds, steps)


def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> Run:
    before = grammar_counters(llm)
    outs: list = []
    seconds = timed(lambda: outs.extend(llm.generate(prompt_token_ids=prompts, sampling_params=params)))
    after = grammar_counters(llm)
    completions = [o.outputs[0] for o in outs]
    return Run(seconds, [len(c.token_ids) for c in completions], [c.text for c in completions],
               [c.finish_reason for c in completions], (after[0] - before[0], after[1] - before[1]))


def constrained_params(count: int, max_tokens: int) -> list[SamplingParams]:
    spec = StructuredOutputParams(json=json.dumps(SCHEMA))
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_output=spec) for _ in range(count)]


def twin_params(lengths: list[int], full_logits: bool = False) -> list[SamplingParams]:
    """The unconstrained twins: exactly the tokens their constrained runs produced. ``full_logits``: through the
    path constrained rows take (the LM head writes the logits and takes the argmax in its GEMM; ``min_tokens=1``,
    a no-op with ``ignore_eos``, keeps them off the argmax-only shortcut), else the engine's default for greedy
    requests (the argmax alone, screened where the CPU supports it)."""
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, min_tokens=int(full_logits))
            for n in lengths]


def grammar_counters(llm: LLM) -> tuple[float, int]:
    """(cumulative seconds filling and applying token masks, steps that masked) from the engine's stats."""
    stats = llm.engine.stats()
    return stats.grammar_mask_seconds_total, stats.grammar_mask_steps_total


def validation_errors(texts: list[str]) -> list[str]:
    """One line per constrained output that is not valid JSON of SCHEMA."""
    errors = []
    for i, text in enumerate(texts):
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            errors.append(f"request {i}: {str(e).splitlines()[0]}: {text[:200]!r}")
    return errors


def compile_seconds(path: str) -> float:
    """The engine's compile of SCHEMA, cold: a new manager, the tokenizer's vocabulary preprocessed first."""
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    start = time.perf_counter()
    manager = StructuredOutputManager(lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB),
                                      max_grammar_bytes=1 << 30, vocab_size=VOCAB)
    manager.compile(StructuredOutputParams(json=json.dumps(SCHEMA))).result()
    return time.perf_counter() - start


def measure(llm: LLM, prompts: list[list[int]], args) -> dict[str, list[Run]]:
    """Warm-up of every mode, then ``args.repeats`` rounds of constrained then its unconstrained twins."""
    warm = generate(llm, prompts[:8], constrained_params(min(8, len(prompts)), args.max_tokens))
    for full_logits in (False, True):
        generate(llm, prompts[:8], twin_params(warm.lengths, full_logits))
    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    for i in range(args.repeats):
        c = generate(llm, prompts, constrained_params(len(prompts), args.max_tokens))
        runs["constrained"].append(c)
        for mode, full_logits in (("unconstrained", False), ("unconstrained_full_logits", True)):
            u = generate(llm, prompts, twin_params(c.lengths, full_logits))
            if u.lengths != c.lengths:
                raise RuntimeError("an unconstrained twin did not generate its constrained run's length")
            runs[mode].append(u)
        print(f"   round {i + 1}/{args.repeats}: " + ", ".join(f"{m} {_tok_s(r[-1]):.1f} tok/s" for m, r in runs.items())
              + f", mean output {statistics.mean(c.lengths):.1f} tokens, {len(validation_errors(c.texts))} invalid",
              flush=True)
    return runs


def _tok_s(run: Run) -> float:
    return sum(run.lengths) / run.seconds[0]


def median(runs: list[Run]) -> Run:
    """The run of median wall time (the slower middle one of an even count, as bench_offline picks)."""
    return sorted(runs, key=lambda r: r.seconds[0])[len(runs) // 2]


def summarize(runs: dict[str, list[Run]]) -> dict:
    """The ratio is against the faster unconstrained path (the baseline at its best on this host)."""
    c, default, full = (median(runs[mode]) for mode in MODES)
    u = min(default, full, key=lambda r: r.seconds[0])
    errors = [e for r in runs["constrained"] for e in validation_errors(r.texts)]
    mask_s, mask_steps = c.mask_fill
    reasons = [f for r in runs["constrained"] for f in r.finish_reasons]
    return {
        "constrained_tok_s": round(_tok_s(c), 1), "unconstrained_tok_s": round(_tok_s(u), 1),
        "unconstrained_argmax_only_tok_s": round(_tok_s(default), 1),
        "unconstrained_full_logits_tok_s": round(_tok_s(full), 1),
        "baseline": "argmax_only" if u is default else "full_logits",
        "ratio": round(_tok_s(c) / _tok_s(u), 3), "target_ratio": TARGET_RATIO,
        "constrained_tok_per_cpu_s": round(sum(c.lengths) / c.seconds[1], 1),
        "unconstrained_tok_per_cpu_s": round(sum(u.lengths) / u.seconds[1], 1),
        "constrained_mean_output_len": round(statistics.mean(c.lengths), 2),
        "unconstrained_mean_output_len": round(statistics.mean(u.lengths), 2),
        "mask_fill_ms_per_step": round(1000 * mask_s / mask_steps, 4) if mask_steps else None,
        "mask_fill_steps": mask_steps, "mask_fill_share_of_wall": round(mask_s / c.seconds[0], 4),
        "num_constrained_outputs": len(reasons), "num_valid": len(reasons) - len(errors),
        "all_valid": not errors, "invalid_examples": errors[:5],
        "finish_reasons": {str(f): reasons.count(f) for f in sorted(set(reasons), key=str)},
    }


def _record(run: Run, with_texts: bool) -> dict:
    record = {"wall_s": round(run.seconds[0], 4), "cpu_s": round(run.seconds[1], 4), "tokens": sum(run.lengths),
              "mask_fill_s": round(run.mask_fill[0], 5), "mask_fill_steps": run.mask_fill[1]}
    return record | ({"texts": run.texts} if with_texts else {})


def plot(runs: dict[str, list[Run]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for offset, (mode, mine) in enumerate(runs.items()):
        ax.bar([i * 4 + offset for i in range(len(mine))], [_tok_s(r) for r in mine], label=mode)
    ax.set_xticks([i * 4 + 1 for i in range(len(runs["constrained"]))],
                  [f"round {i + 1}" for i in range(len(runs["constrained"]))])
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"JSON schema vs unconstrained, {MODEL}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--png", help="draw each round's tok/s here (needs matplotlib: the bench extra)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests, all submitted at once")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of constrained then the unconstrained twins")
    parser.add_argument("--max-tokens", type=int, default=256, help="the constrained requests' cap")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="ext", choices=["ext", "torch"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        print(f"== {MODEL} with a {VOCAB}-token BPE tokenizer", flush=True)
        path = write_model(folder)
        compile_s = compile_seconds(path)
        llm = LLM(path, **pagedserve_config(args.threads, args.backend))
        prompts = [r.prompt for r in make_workload("alpaca", args.num_requests, VOCAB, args.seed)]
        print(f"-- {len(prompts)} requests, mean prompt {statistics.mean(map(len, prompts)):.0f} tokens; "
              f"schema compiled cold in {compile_s * 1000:.1f} ms", flush=True)
        runs = measure(llm, prompts, args)
    summary = {"compile_s": round(compile_s, 4), **summarize(runs)}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(output_path(args.json), "w") as f:
            json.dump({"args": vars(args), "cpu_count": os.cpu_count(), "model": MODEL, "schema": SCHEMA,
                       "summary": summary,
                       "runs": {mode: [_record(r, with_texts=mode == "constrained") for r in mine]
                                for mode, mine in runs.items()}}, f, indent=2)
    if args.png:
        plot(runs, output_path(args.png))
    return summary


if __name__ == "__main__":
    main()
