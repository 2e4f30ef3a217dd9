"""Beam search throughput: pagedserve (candidates on a shared block tree) vs transformers' beam search.

    python -m loadtest.bench_beam [--width 4] [--num-requests 32] [--workload alpaca] [--model llama-19m]
    python -m loadtest.bench_offline ... --beam-width 4     (the same, after the offline benchmark)

Same random-weight checkpoint, same prompts and output lengths (``bench_offline``'s synthetic
workloads, ``ignore_eos`` so every beam runs its full length), same run. transformers runs
``generate(num_beams=W, do_sample=False)`` in static batches (left-padded, each batch generating its
longest output; ``--batch-sizes`` are tried and the best is kept); pagedserve runs every request at
once as a beam search of width W. Throughput counts the requested output tokens of the returned best
beam per request (padding and the other beams are the same work for both), so the ratio is one of
requests per second.
"""
from __future__ import annotations

import argparse
import json
import tempfile

import torch
import transformers

from engine import LLM, SamplingParams
from loadtest.bench_offline import MODELS, Request, make_workload, timed, write_checkpoint


def beam_params(r: Request, width: int) -> SamplingParams:
    return SamplingParams(best_of=width, use_beam_search=True, temperature=0.0, max_tokens=r.output_len,
                          ignore_eos=True)


def run_pagedserve(llm: LLM, requests: list[Request], width: int) -> None:
    outs = llm.generate(prompt_token_ids=[r.prompt for r in requests],
                        sampling_params=[beam_params(r, width) for r in requests], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == r.output_len for o, r in zip(outs, requests))


def time_pagedserve(path: str, requests: list[Request], width: int, threads: int, backend: str) -> float:
    llm = LLM(path, skip_tokenizer_init=True, attention_backend=backend, num_threads=threads,
              max_num_seqs=256, max_num_batched_tokens=2048, show_progress=False)
    run_pagedserve(llm, [Request(r.prompt, 4) for r in requests[:4]], width)  # warm-up
    return timed(lambda: run_pagedserve(llm, requests, width))[0]


@torch.inference_mode()
def run_hf(model, requests: list[Request], width: int, batch_size: int) -> None:
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        longest = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[0] * (longest - len(r.prompt)) + r.prompt for r in batch])  # left padding
        mask = (torch.arange(longest) >= longest - torch.tensor([len(r.prompt) for r in batch])[:, None]).long()
        new = max(r.output_len for r in batch)
        model.generate(ids, attention_mask=mask, do_sample=False, num_beams=width, max_new_tokens=new,
                       pad_token_id=0)  # the checkpoint has no eos: every beam runs max_new_tokens


def bench_beam(model_name: str, width: int, num_requests: int, threads: int, backend: str, seed: int = 0,
               workload: str = "alpaca", batch_sizes: tuple[int, ...] = (4, 16)) -> dict:
    """One row: both systems' requests/s on the same prompts, and pagedserve's ratio."""
    torch.set_num_threads(threads)
    requests = make_workload(workload, num_requests, MODELS[model_name]["config"]["vocab_size"], seed)
    tokens = sum(r.output_len for r in requests)
    with tempfile.TemporaryDirectory() as folder:
        path = write_checkpoint(model_name, folder)
        paged_wall = time_pagedserve(path, requests, width, threads, backend)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, MODELS[model_name]["dtype"]), attn_implementation="sdpa").eval()
        run_hf(model, requests[:2], width, 2)  # warm-up
        hf = {b: timed(lambda: run_hf(model, requests, width, b))[0] for b in batch_sizes}
    best = min(hf, key=hf.get)
    row = {"model": model_name, "workload": workload, "beam_width": width, "num_requests": len(requests),
           "output_tokens": tokens, "pagedserve_req_s": len(requests) / paged_wall,
           "hf_beam_req_s": len(requests) / hf[best], "hf_best_batch_size": best,
           "hf_req_s_by_batch_size": {b: len(requests) / s for b, s in hf.items()},
           "ratio_vs_hf_beam": hf[best] / paged_wall}
    print(f"beam search width {width}, {len(requests)} {workload}-like requests on {model_name}: pagedserve "
          f"{row['pagedserve_req_s']:.2f} req/s, transformers {row['hf_beam_req_s']:.2f} req/s "
          f"(batch {best}): {row['ratio_vs_hf_beam']:.2f}x", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--model", default="llama-19m", choices=sorted(MODELS))
    parser.add_argument("--workload", default="alpaca", choices=["alpaca", "sharegpt"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="ext", choices=["ext", "torch"])
    parser.add_argument("--batch-sizes", default="4,16", help="transformers batch sizes to try (best is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the row here")
    args = parser.parse_args()
    row = bench_beam(args.model, args.width, args.num_requests, args.threads, args.backend, args.seed,
                     args.workload, tuple(int(b) for b in args.batch_sizes.split(",")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
