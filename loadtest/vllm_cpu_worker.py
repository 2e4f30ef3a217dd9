"""vLLM's CPU build as a peer of ``bench_offline``, run inside vLLM's own virtual environment (vLLM pins its own
torch and transformers, so it never shares the project's): ``loadtest/vllm_cpu_peer.py`` starts this file with that
environment's Python and talks to it in JSON lines.

    argv[1]: {"checkpoint": path, "dtype": "float32", "enforce_eager": bool, "max_num_seqs": n,
              "max_num_batched_tokens": n, "max_model_len": n}
    stdout:  {"ready": true, "load_s": seconds} once the model is loaded, then one answer per stdin line
    stdin:   {"prompts": [[token ids]], "output_lens": [n]} -> {"wall_s", "cpu_s", "outputs": [[token ids]]}

The checkpoint has no tokenizer: prompts go in as token ids, outputs come back as token ids (greedy, EOS ignored,
exactly ``output_lens`` tokens each). CPU seconds cover this process and the engine-core process vLLM starts.
"""
from __future__ import annotations

import json
import os
import sys
import time


def cpu_seconds() -> float:
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def answer(out, message: dict) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def main() -> None:
    settings = json.loads(sys.argv[1])
    # vLLM logs to stdout: the answers keep the original stdout, everything else goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=settings["checkpoint"], skip_tokenizer_init=True, dtype=settings["dtype"],
              enforce_eager=settings["enforce_eager"], max_num_seqs=settings["max_num_seqs"],
              max_num_batched_tokens=settings["max_num_batched_tokens"], max_model_len=settings["max_model_len"],
              seed=0)
    answer(out, {"ready": True, "load_s": time.perf_counter() - start})
    for line in sys.stdin:
        job = json.loads(line)
        prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
        params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)
                  for n in job["output_lens"]]
        wall, cpu = time.perf_counter(), cpu_seconds()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        answer(out, {"wall_s": wall, "cpu_s": cpu, "outputs": [list(o.outputs[0].token_ids) for o in outputs]})


if __name__ == "__main__":
    main()
