"""Speculative decoding on this machine: tokens per second with and without speculation, in one run.

    python -m loadtest.bench_spec [--batch-sizes 1,4,16] [--methods ngram,draft] [--output-len 128] [--k 4]
                                  [--json results.json]

The target has Qwen2-0.5B's shape and cost (24 layers, hidden 896, 14 heads / 2 KV heads, vocabulary 151936,
tied embeddings, bfloat16), but random weights never repeat their context, so n-gram proposals would never be
accepted. Its weights are set so that it writes text a prompt can quote: over a "chain" of ``CHAIN`` tokens in
a random order, each chain token's embedding is a unit vector and layer 0's MLP maps it to its successor (one
hidden unit per chain token: gate and up read the token, down writes successor minus token); every attention
output projection and the later layers' MLP outputs are zero, everything else stays random (and is computed:
the step costs what Qwen2-0.5B's costs). Its greedy text after a chain token is the chain from there on,
whatever precedes it. Acceptance is measured, not assumed: it is how often the target's own greedy tokens are
the ones the n-gram lookup found in the prompt.

The draft model (``--methods draft``) is the target's first ``--draft-layers`` layers (2) with its embeddings,
final norm and LM head: it holds layer 0's chain map, so it proposes what the target writes; its step still
costs the full LM head (151936 x 896), about a third of the target's step.

Workloads (every request greedy, ``ignore_eos``, ``--output-len`` tokens):

* ``quote``: a passage of the chain, some unrelated tokens, then the passage's first token: the output quotes the
  passage (a code edit or a summary repeating its source).
* ``mismatch``: every chain bigram the output will write appears in the prompt, each followed by two unrelated
  tokens: every lookup proposes tokens the target rejects (acceptance 0 for ngram), the case where speculation
  must back off and cost nothing (the draft model knows the chain here too).

For each batch size b (b requests at once) the plain engine and one per proposer run the same requests after a
warm-up; the outputs are checked identical and each result holds tokens/s of plain and speculative decoding,
their ratio, the acceptance rate (accepted / proposed
tokens) and the mean accepted length (tokens per verification). ``--repeats`` alternates the engines and keeps
each one's median run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import transformers

from engine import LLM, SamplingParams
from loadtest.bench_offline import MODELS

CHAIN = 4096  # chain tokens: at most layer 0's MLP width (4864), one hidden unit each
_FIRST_CHAIN_ID = 1000


@dataclass
class Result:
    workload: str
    batch_size: int
    method: str  # the proposer
    tokens_per_s_plain: float
    tokens_per_s_spec: float
    speedup: float
    acceptance_rate: float
    mean_accepted_length: float
    num_drafts: int


def build_target(folder: str, seed: int) -> list[int]:
    """Writes the quoting Qwen2-0.5B-shaped checkpoint to ``folder``; returns its chain in order."""
    config = transformers.Qwen2Config(**MODELS["qwen2-0.5b"]["config"], bos_token_id=None, eos_token_id=None,
                                      pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    chain = (torch.randperm(config.vocab_size - _FIRST_CHAIN_ID)[:CHAIN] + _FIRST_CHAIN_ID).tolist()
    with torch.no_grad():
        _wire_chain(model, chain)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    return chain


def _wire_chain(model: transformers.PreTrainedModel, chain: list[int]) -> None:
    embed = model.model.embed_tokens.weight  # tied: the LM head reads the same rows
    codes = torch.nn.functional.normalize(torch.randn(len(chain), embed.shape[1]), dim=1)
    embed[chain] = codes
    # RMSNorm of a unit vector is sqrt(hidden) times it; gate and up read the token, so its hidden unit's output
    # is silu(a * s) * s. down scales successor - token so the residual becomes 2 * successor - token: the
    # successor's logit is the largest by far, the token's own is negative.
    scale, a = embed.shape[1] ** 0.5, 1.0
    unit = torch.nn.functional.silu(torch.tensor(a * scale)) * scale
    mlp = model.model.layers[0].mlp
    mlp.gate_proj.weight.zero_()
    mlp.up_proj.weight.zero_()
    mlp.down_proj.weight.zero_()
    mlp.gate_proj.weight[:len(chain)] = a * codes
    mlp.up_proj.weight[:len(chain)] = codes
    successors = torch.roll(codes, -1, dims=0)
    mlp.down_proj.weight[:, :len(chain)] = (2.0 * (successors - codes) / unit).T
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.o_proj.weight.zero_()
        if i:
            layer.mlp.down_proj.weight.zero_()


def make_requests(workload: str, chain: list[int], count: int, output_len: int, rng: random.Random
                  ) -> list[list[int]]:
    junk = lambda n: [rng.randrange(_FIRST_CHAIN_ID // 2, _FIRST_CHAIN_ID) for _ in range(n)]  # noqa: E731
    prompts = []
    for _ in range(count):
        start = rng.randrange(CHAIN - output_len - 2)
        passage = chain[start:start + output_len + 2]
        if workload == "quote":
            prompts.append(junk(32) + passage + junk(16) + passage[:1])
        else:  # mismatch: each bigram the output writes, followed by tokens it will not write
            units = [passage[j:j + 2] + junk(2) for j in range(output_len + 1)]
            rng.shuffle(units)
            prompts.append([t for unit in units for t in unit] + passage[:1])
    return prompts


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return time.perf_counter() - started, [o.outputs[0].token_ids for o in outs]


def bench(paths: dict[str, str], chain: list[int], workload: str, batch_size: int, args) -> list[Result]:
    rng = random.Random(args.seed + batch_size)
    prompts = make_requests(workload, chain, batch_size, args.output_len, rng)
    warmup = make_requests(workload, chain, batch_size, 8, rng)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    common = dict(skip_tokenizer_init=True, attention_backend=args.backend, num_threads=args.threads,
                  max_model_len=2048, max_num_seqs=batch_size, show_progress=False)
    engines = {"plain": LLM(paths["target"], **common)}
    for method in args.methods:
        engines[method] = LLM(paths["target"], speculative_method=method, num_speculative_tokens=args.k,
                              speculative_model=paths["draft"] if method == "draft" else None, **common)
    for llm in engines.values():
        llm.generate(prompt_token_ids=warmup, sampling_params=SamplingParams(temperature=0.0, max_tokens=8,
                                                                             ignore_eos=True), use_tqdm=False)
    before = {name: llm.engine.stats() for name, llm in engines.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs = {}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            seconds, outputs[name] = timed_generate(llm, prompts, params)
            times[name].append(seconds)
    tokens = batch_size * args.output_len
    plain = tokens / statistics.median(times["plain"])
    results = []
    for method in args.methods:
        if outputs[method] != outputs["plain"]:
            raise AssertionError(f"{workload}, batch {batch_size}, {method}: outputs differ from plain decoding")
        after = engines[method].engine.stats()
        drafts, proposed, accepted = (
            getattr(after, f) - getattr(before[method], f) for f in (
                "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                "spec_decode_num_accepted_tokens_total"))
        spec = tokens / statistics.median(times[method])
        results.append(Result(workload, batch_size, method, round(plain, 2), round(spec, 2), round(spec / plain, 3),
                              round(accepted / proposed, 3) if proposed else 0.0,
                              round(1 + accepted / drafts, 2) if drafts else 0.0, drafts))
    return results


def build_draft(target: str, folder: str, num_layers: int) -> None:
    """The target's first ``num_layers`` layers (embeddings, final norm and LM head shared) as a checkpoint."""
    config = transformers.AutoConfig.from_pretrained(target)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    model = transformers.AutoModelForCausalLM.from_pretrained(target, config=config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--workloads", default="quote,mismatch", help="comma list of quote, mismatch")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--methods", default="ngram,draft", help="comma list of proposers: ngram, draft")
    parser.add_argument("--draft-layers", type=int, default=2, help="the draft model: the target's first layers")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="ext", choices=["ext", "torch"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    args.methods = args.methods.split(",")
    with tempfile.TemporaryDirectory() as folder:
        paths = {"target": os.path.join(folder, "target"), "draft": os.path.join(folder, "draft")}
        chain = build_target(paths["target"], args.seed)
        if "draft" in args.methods:
            build_draft(paths["target"], paths["draft"], args.draft_layers)
        for workload in args.workloads.split(","):
            for batch_size in (int(b) for b in args.batch_sizes.split(",")):
                for result in bench(paths, chain, workload, batch_size, args):
                    print(json.dumps(asdict(result)), flush=True)
                    results.append(asdict(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu_count": os.cpu_count(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
