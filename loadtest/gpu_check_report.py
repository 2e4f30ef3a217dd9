"""loadtest/gpu_check.sh's one JSON, from its steps so far (rewritten after each step).

    python -m loadtest.gpu_check_report STEPS_TSV LOG_DIR OUT_JSON DEVICE DRY_RUN

Each step: its command, exit status (124/137: over its time limit), seconds, the last lines of its log and
the JSON it wrote (when it wrote one). With both profile_step runs, ``graphs_vs_eager`` holds the ratios of
their per-step times (eager / graphs: above 1, the graphs are faster)."""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

_LOG_TAIL_LINES = 25


def read_steps(steps_tsv: Path, logs: Path) -> list[dict]:
    steps = []
    for line in steps_tsv.read_text().splitlines():
        name, rc, start, end, result, command = line.split("\t", 5)
        log = logs / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:] if log.exists() else []
        loaded = json.loads(Path(result).read_text()) if result != "-" and Path(result).exists() else None
        steps.append({"name": name, "command": command, "rc": int(rc), "ok": rc == "0",
                      "timed_out": rc in ("124", "137"), "seconds": round(float(end) - float(start), 2),
                      "log_tail": tail, "result": loaded})
    return steps


def graphs_vs_eager(steps: list[dict]) -> dict[str, float] | None:
    """eager / graphs for each per-step time both profile_step runs measured."""
    by_name = {s["name"]: s["result"] for s in steps if s["result"] is not None}
    graphs, eager = by_name.get("profile_graphs"), by_name.get("profile_eager")
    if graphs is None or eager is None:
        return None
    pairs = {"step_ms": (eager["ms_per_step"]["step"], graphs["ms_per_step"]["step"])}
    for key in ("wall_ms", "gpu_ms", "kernels_per_step"):
        if key in eager.get("cuda", {}) and key in graphs.get("cuda", {}):
            pairs[key] = (eager["cuda"][key], graphs["cuda"][key])
    return {key: round(e / g, 3) for key, (e, g) in pairs.items() if g}


def environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cpu_count": os.cpu_count(), "device": device}
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def main() -> None:
    steps_tsv, logs, out, device, dry_run = sys.argv[1:6]
    steps = read_steps(Path(steps_tsv), Path(logs))
    report = {"dry_run": dry_run == "1", "environment": environment(device), "all_ok": all(s["ok"] for s in steps),
              "total_seconds": round(sum(s["seconds"] for s in steps), 2), "graphs_vs_eager": graphs_vs_eager(steps),
              "steps": steps}
    Path(out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
