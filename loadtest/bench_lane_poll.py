"""Step lane poll benchmark: new requests polled before each step against after it, one trace, one run.

    python -m loadtest.bench_lane_poll [--json FILE] [--num-requests 40] [--request-rate 2] [--repeats 2]

The worker's step lane (``service.step_lane``) polls Redis for new requests either with the publish, just
before the step (``--poll-after-step 1e9``: never after), or in an exchange of its own just after it
(``--poll-after-step 0``: always after). Polled before, a request that arrives during step k is read after
step k+1 and joins step k+2; polled after, it joins step k+1. The model is a 25M-parameter Llama with the
demo model's tokenizer (random weights, fp32, one torch thread), so that a step lasts long enough (about 15
ms here) for a step of waiting to show. Each mode serves the same Poisson trace on a fresh stack
(redis-server, one worker, one gateway), the modes alternating ``--repeats`` times. Reported: TTFT (mean,
median, p99) and the inter-token latency each mode gave, and the after / before ratios of the medians.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import shutil
import statistics

import torch
import transformers

from engine import EngineConfig
from engine.demo_model import ensure_demo_model
from loadtest.bench_offline import Request
from loadtest.bench_serving import run_client, served_stack, summarize, warm_up

MODES = {"before": ["--poll-after-step", "1e9"], "after": ["--poll-after-step", "0"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--request-rate", type=float, default=2.0, help="Poisson rate, requests/s")
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model-dir", default=os.path.join("results", "bench-lane-poll-model"))
    p.add_argument("--json", help="write the results here")
    return p.parse_args()


def write_model(folder: str) -> str:
    """A Llama of 8 layers x 512 with the demo model's 512-token tokenizer (the gateway detokenizes)."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    print(f"writing the benchmark's model to {folder} ...", flush=True)
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=512,
                                      max_position_embeddings=2048, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    demo = ensure_demo_model()
    for file in glob.glob(os.path.join(demo, "*token*")) + glob.glob(os.path.join(demo, "*.jinja")):
        shutil.copy(file, folder)
    return folder


def serve(model: str, mode: str, requests: list[Request], rate: float) -> dict:
    config = EngineConfig(model=model, num_threads=1, max_num_seqs=32, num_device_blocks=2048,
                          attention_backend="torch")
    with served_stack(model, config, MODES[mode]) as stack:
        stack.wait_ready(180)
        asyncio.run(run_client(stack.url, warm_up(requests), float("inf"), None, 1))
        stats, duration = asyncio.run(run_client(stack.url, requests, rate, None, 0))
    return summarize(stats, duration)


def main() -> None:
    args = parse_args()
    model = write_model(args.model_dir)
    rng = random.Random(0)
    requests = [Request([rng.randrange(3, 500) for _ in range(rng.randint(16, 64))], args.output_tokens)
                for _ in range(args.num_requests)]
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            print(f"run {repeat + 1}/{args.repeats}, poll {mode} the step ...", flush=True)
            r = serve(model, mode, requests, args.request_rate)
            runs[mode].append(r)
            print(f"  TTFT mean {r['ttft']['mean_ms']:.1f} ms, median {r['ttft']['median_ms']:.1f} ms, p99 "
                  f"{r['ttft']['p99_ms']:.1f} ms; ITL median {r['itl']['median_ms']:.2f} ms; "
                  f"{r['failed']} failed", flush=True)
    medians = {mode: {key: statistics.median(r[key]["median_ms"] for r in runs[mode]) for key in ("ttft", "itl")}
               for mode in MODES}
    ratios = {f"{key}_median_after_vs_before": medians["after"][key] / medians["before"][key] for key in ("ttft", "itl")}
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "ratios": ratios, "config": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
