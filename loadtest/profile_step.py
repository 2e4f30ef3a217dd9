"""Where one engine step's time goes, on a steady decode with the real engine.

    python -m loadtest.profile_step --device cpu --num-seqs 64 [--model llama-19m] [--steps 200] [--threads 2]
                                    [--split-layers]

Writes bench_offline's random-weight checkpoint of ``--model``, starts ``--num-seqs`` greedy requests
(``--prompt-len`` tokens each, long enough outputs that none finishes), steps past their prefill, then
times ``--steps`` decode steps. Per step, in ms:

* layers: the decoder layers that run as one compiled call (CPU: their GEMMs, attention and fused ops together;
  ``--split-layers`` runs the per-op Python forward instead, to see those parts apart)
* gemm: every other linear layer, the LM head included (the skinny GEMM on CPU; the LM head's fused argmax too)
* attention: the other paged attention layers (K/V write + attention)
* model other: the rest of the forward (embedding, fused norms, rotary, SiLU-and-mul, the layers' Python)
* sampler, scheduler (``schedule`` + ``update_from_output``), prepare (the runner's input tensors)
* other: the rest of ``LLMEngine.step`` (the runner's logits row pick, ...); the outputs are built in ``update_from_output``

On CUDA the timers synchronize after each part, so first ``--steps`` steps run untimed but for one
synchronize at the end (``cuda``: wall ms per step, GPU ms per step from CUDA events around them), then
``--profile-steps`` under torch.profiler count each step's kernel launches and graph replays (host API calls)
and the kernels' device time (the top kernels by total time). ``--enforce-eager`` turns the decode graphs off
(the part timers do not see inside a graph replay: its layers count as "other").

"Python overhead" is the step's wall time minus the model's (forward + LM head): the time the
engine spends outside the model. Each part is also measured in process CPU time (all threads): on a
shared machine a descheduled process inflates wall times, while the CPU time of the single-threaded
Python parts stays what they cost (with ``--threads 1``: with more, the pool's idle threads spin
during the Python parts and count too). ``instrument`` is reused by ``bench_offline`` for its breakdown.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.distributed.executor import ModelExecutor
from engine.layers.attention import PagedAttention
from engine.layers.linear import Linear
from engine.layers.vocab_parallel import ParallelLMHead
from engine.llm_engine import LLMEngine

# What the wrappers measure (nested: gemm and attention are inside model, model inside step).
_TIMED = ("step", "scheduler", "prepare", "model", "layers", "gemm", "attention", "sampler")


@dataclass(slots=True)
class StepTimers:
    """Accumulated wall and process-CPU seconds per timed part; ``breakdown`` turns them into ms per step."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_TIMED, 0.0))
    cpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_TIMED, 0.0))
    steps: int = 0
    sync: Callable[[], None] | None = None  # a CUDA device's synchronize, so kernel time lands in its part

    def wrap(self, owner: object, name: str, part: str) -> None:
        """Replace ``owner.name`` (an instance attribute shadowing the method) by a timed call."""
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync is not None:
                    self.sync()
                self.seconds[part] += time.perf_counter() - start
                self.cpu_seconds[part] += time.process_time() - cpu_start
        setattr(owner, name, timed)

    def breakdown(self, cpu: bool = False) -> dict[str, float]:
        """ms per step (wall, or process CPU time with ``cpu``): layers, gemm, attention, model_other, sampler,
        scheduler, prepare, other, step, python_overhead."""
        ms = {k: 1e3 * v / max(1, self.steps) for k, v in (self.cpu_seconds if cpu else self.seconds).items()}
        outside = ms["scheduler"] + ms["prepare"] + ms["model"] + ms["sampler"]
        return {"layers": ms["layers"], "gemm": ms["gemm"], "attention": ms["attention"],
                "model_other": ms["model"] - ms["layers"] - ms["gemm"] - ms["attention"], "sampler": ms["sampler"],
                "scheduler": ms["scheduler"], "prepare": ms["prepare"], "other": ms["step"] - outside,
                "step": ms["step"], "python_overhead": ms["step"] - ms["model"]}


def instrument(engine: LLMEngine) -> StepTimers:
    """Time ``engine``'s steps and their parts from now on (wrappers cost ~1 us per call, ~25 calls a step)."""
    timers = StepTimers(sync=torch.cuda.synchronize if engine.config.device.type == "cuda" else None)
    step = engine.step

    def counted_step():
        timers.steps += 1
        return step()
    engine.step = counted_step
    timers.wrap(engine, "step", "step")
    timers.wrap(engine.scheduler, "schedule", "scheduler")
    timers.wrap(engine.scheduler, "update_from_output", "scheduler")
    # With tensor parallelism, rank 0's runner: the other ranks run the same plan on their shards meanwhile.
    runner = engine.runner.runner if isinstance(engine.runner, ModelExecutor) else engine.runner
    timers.wrap(runner, "_prepare", "prepare")
    timers.wrap(engine.sampler, "sample", "sampler")
    model = runner.model
    timers.wrap(model, "forward", "model")
    timers.wrap(model, "compute_logits", "model")
    for module in model.modules():
        if getattr(module, "fused", None) is not None:
            timers.wrap(module, "fused", "layers")
        if isinstance(module, ParallelLMHead):  # its GEMM (with the fused argmax) runs through with_argmax
            timers.wrap(module, "with_argmax", "gemm")
        elif isinstance(module, Linear):
            timers.wrap(module, "forward", "gemm")
        elif isinstance(module, PagedAttention):
            timers.wrap(module, "forward", "attention")
    return timers


def unfuse(engine: LLMEngine) -> None:
    """Every decoder layer back on its per-op Python forward (rank 0's; tensor parallelism never fuses)."""
    for module in engine.runner.model.modules():
        if getattr(module, "fused", None) is not None:
            module.fused = None


def start_decode(engine: LLMEngine, num_seqs: int, prompt_len: int, steps: int, vocab: int) -> None:
    """``num_seqs`` sequences past their prefill, with room for ``steps`` more decode steps."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", torch.randint(vocab, (prompt_len,), generator=gen).tolist(), params)
    while engine.scheduler.waiting or any(s.is_prefill for g in engine.scheduler.running.values() for s in g.seqs):
        engine.step()
    for _ in range(4):  # warm caches and allocator at the decode shape
        engine.step()


def steady_decode(engine: LLMEngine, num_seqs: int, prompt_len: int, steps: int, vocab: int) -> StepTimers:
    """``steps`` timed steps with ``num_seqs`` sequences decoding (prefills done before timing starts)."""
    start_decode(engine, num_seqs, prompt_len, steps, vocab)
    timers = instrument(engine)
    for _ in range(steps):
        engine.step()
    return timers


def cuda_steps(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Wall and GPU ms per step over ``steps`` uninstrumented steps (one synchronize, at the end)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    wall = time.perf_counter()
    start.record()
    for _ in range(steps):
        engine.step()
    end.record()
    torch.cuda.synchronize()
    return {"wall_ms": 1e3 * (time.perf_counter() - wall) / steps, "gpu_ms": start.elapsed_time(end) / steps}


def cuda_kernels(engine: LLMEngine, steps: int, top: int = 10) -> dict:
    """Per step under torch.profiler: host launch calls by name, kernels run, their device ms; the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = {e.key: e.count / steps for e in events if e.key.startswith(("cudaLaunch", "cudaGraphLaunch",
                                                                             "cuLaunch", "cudaMemcpy"))}
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    return {"host_calls_per_step": launches,
            "kernels_per_step": sum(e.count for e in kernels) / steps,
            "kernel_ms_per_step": sum(e.device_time_total for e in kernels) / 1e3 / steps,
            "top_kernels": [{"name": e.key[:120], "ms_per_step": e.device_time_total / 1e3 / steps,
                             "calls_per_step": e.count / steps} for e in kernels[:top]]}


def main() -> None:
    from loadtest.bench_offline import MODELS, write_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--model", default="llama-19m", choices=sorted(MODELS))
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="ext", choices=["ext", "torch"])
    parser.add_argument("--split-layers", action="store_true",
                        help="run the decoder layers' per-op Python forward, not their compiled call")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for the decode steps")
    parser.add_argument("--profile-steps", type=int, default=20, help="CUDA: steps under torch.profiler")
    parser.add_argument("--json", help="write the breakdown here")
    args = parser.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    with tempfile.TemporaryDirectory() as folder:
        path = write_checkpoint(args.model, folder)
        engine = LLMEngine(EngineConfig(model=path, device=args.device, num_threads=args.threads,
                                        attention_backend=args.backend, max_num_seqs=args.num_seqs,
                                        enable_prefix_caching=False, show_progress=False,
                                        enforce_eager=args.enforce_eager))
        if args.split_layers:
            unfuse(engine)
        vocab, gpu = MODELS[args.model]["config"]["vocab_size"], {}
        if cuda:  # untimed parts first: the timers' synchronizes would serialize them
            start_decode(engine, args.num_seqs, args.prompt_len, 3 * args.steps + args.profile_steps, vocab)
            gpu = cuda_steps(engine, args.steps) | cuda_kernels(engine, args.profile_steps)
            timers = instrument(engine)
            for _ in range(args.steps):
                engine.step()
        else:
            timers = steady_decode(engine, args.num_seqs, args.prompt_len, args.steps, vocab)
    wall, cpu = timers.breakdown(), timers.breakdown(cpu=True)
    if gpu:
        print(f"CUDA, {args.steps} uninstrumented steps: {gpu['wall_ms']:.3f} ms wall, {gpu['gpu_ms']:.3f} ms GPU "
              f"per step; per step: {gpu['kernels_per_step']:.0f} kernels, host calls {gpu['host_calls_per_step']}")
        for k in gpu["top_kernels"]:
            print(f"  {k['ms_per_step']:8.3f} ms {k['calls_per_step']:6.1f}x  {k['name']}")
    print(f"{args.model}, {args.num_seqs} decoding sequences, {args.threads} threads, {args.steps} steps "
          f"({args.num_seqs * 1e3 / wall['step']:.0f} tok/s); ms per step, wall and process CPU time:")
    for part in wall:
        print(f"  {part:<16} {wall[part]:8.3f} {cpu[part]:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ms_per_step": wall, "cpu_ms_per_step": cpu, "cuda": gpu}, f, indent=2)


if __name__ == "__main__":
    main()
