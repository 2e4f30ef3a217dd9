"""Images in: throughput and TTFT of one-image chat requests against transformers' ``generate`` on the same
requests, and the encoder cache's effect (the same image in every request against a distinct one each).

    python -m loadtest.bench_vision [--num-requests 16] [--max-tokens 32] [--image-size 224] [--threads 2]
                                    [--family qwen2.5-vl|qwen3-vl|gemma3]

Model: a random-weight Qwen2.5-VL (8-pixel patches) or Qwen3-VL (16-pixel patches, DeepStack) built here
(loadtest/vl_checkpoint.py; ``--layers`` text layers of 4 heads x 64, a ``--depth``-block tower of width 128,
fp32), its image processor and a character tokenizer; ``--family gemma3``:
a Gemma 3 of ``--layers`` text layers of 4 heads x 32 (sliding and global in turn) behind a ``--depth``-layer
SigLIP tower of width 128, each image resized to its 56-pixel square (16 image tokens, whatever ``--image-size``).
Requests: "Describe <image> briefly." with a random ``--image-size`` pixel square image each (distinct seeds),
greedy, ``ignore_eos``, ``--max-tokens`` new tokens; all submitted at once to the engine (``LLM.generate``), one
after another to transformers (``generate`` with the processor's pixel values; eager attention). TTFT: the
engine's from each request's arrival to its first token; transformers' is, for request i, the full runs of the
requests before it plus its own prefill (a ``max_new_tokens=1`` run), as a server that serves one request at a time
would give. Every engine output is checked token-exact against transformers' first (fp32 greedy).

Encoder cache: prefix caching off, so only the encoder cache can spare work; the same requests with one image
repeated in every request against distinct images, reporting the vision tower's calls and images encoded
(EncoderCache.misses), wall time and mean TTFT.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from engine import LLM, SamplingParams
from loadtest.vl_checkpoint import (GEMMA_PLACEHOLDER, PLACEHOLDER, build_vl_checkpoint, gemma3_vl_config,
                                    hf_vl_greedy, image, qwen3_vl_config, vl_config)

# Each family's config builder and prompt (its chat template's image placeholder).
FAMILIES = {"qwen2.5-vl": (vl_config, "Describe " + PLACEHOLDER + " briefly."),
            "qwen3-vl": (qwen3_vl_config, "Describe " + PLACEHOLDER + " briefly."),
            "gemma3": (gemma3_vl_config, "Describe " + GEMMA_PLACEHOLDER + " briefly.")}


def engine_run(path: str, prompt: str, images: list, max_tokens: int, threads: int, prefix_caching: bool) -> dict:
    llm = LLM(path, dtype="float32", num_device_blocks=1024, num_threads=threads, show_progress=False,
              enable_prefix_caching=prefix_caching)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": img}} for img in images], params,
                           use_tqdm=False)
    wall = time.perf_counter() - start
    cache = llm.engine.runner.images.cache
    return {"tokens": [o.outputs[0].token_ids for o in outputs], "wall_s": wall,
            "ttft_s": statistics.mean(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs),
            "encoded": cache.misses, "cache_hits": cache.hits,
            "image_tokens": outputs[0].prompt_token_ids.count(llm.engine.images.spec.image_token_id)}


def transformers_run(model, path: str, prompt: str, images: list, max_tokens: int) -> dict:
    tokens, ttfts, elapsed = [], [], 0.0
    for img in images:
        start = time.perf_counter()
        hf_vl_greedy(model, path, prompt, [img], 1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        tokens.append(hf_vl_greedy(model, path, prompt, [img], max_tokens))
        ttfts.append(elapsed + prefill)
        elapsed += time.perf_counter() - start
    return {"tokens": tokens, "wall_s": elapsed, "ttft_s": statistics.mean(ttfts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224,
                        help="pixels a side (a multiple of 16 for qwen2.5-vl, of 32 for qwen3-vl)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen2.5-vl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    side = args.image_size
    distinct = [image(seed, side, side) for seed in range(args.num_requests)]
    config, prompt = FAMILIES[args.family]
    with tempfile.TemporaryDirectory() as path:
        model = build_vl_checkpoint(path, config(layers=args.layers, heads=4, depth=args.depth, vision_hidden=128))
        hf = transformers_run(model, path, prompt, distinct, args.max_tokens)
        ours = engine_run(path, prompt, distinct, args.max_tokens, args.threads, prefix_caching=True)
        if ours["tokens"] != hf["tokens"]:
            raise SystemExit("the engine's outputs differ from transformers': no figures")
        repeated = engine_run(path, prompt, [distinct[0]] * args.num_requests, args.max_tokens, args.threads, False)
        fresh = engine_run(path, prompt, distinct, args.max_tokens, args.threads, False)
    generated = args.num_requests * args.max_tokens
    print(f"{args.family}: {args.num_requests} requests, one {side}x{side} image each ({ours['image_tokens']} image "
          f"tokens), {args.max_tokens} new tokens, {args.threads} threads")
    print("| run | output tok/s | mean TTFT (s) | wall (s) | images encoded |\n|---|---|---|---|---|")
    for name, run in (("transformers generate, one at a time", hf), ("pagedserve LLM.generate", ours),
                      ("pagedserve, distinct images, no prefix cache", fresh),
                      ("pagedserve, one image repeated, no prefix cache", repeated)):
        print(f"| {name} | {generated / run['wall_s']:.1f} | {run['ttft_s']:.3f} | {run['wall_s']:.2f} "
              f"| {run.get('encoded', args.num_requests)} |")
    print(f"throughput vs transformers: {hf['wall_s'] / ours['wall_s']:.2f}x; encoder cache, repeated vs distinct: "
          f"{fresh['wall_s'] / repeated['wall_s']:.2f}x wall, {fresh['ttft_s'] / repeated['ttft_s']:.2f}x TTFT")


if __name__ == "__main__":
    main()
