"""PNG figures of ``loadtest.paper``'s report, in the style of the paper's figures."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)

PARTS = (("stored", "Token states", "#4c9a5b"), ("reserved", "Reservation", "#e0a030"),
         ("internal", "Internal frag.", "#d05050"), ("external", "External frag.", "#8060b0"))
LABELS = {"paged": "PagedAttention", "contiguous-oracle": "Orca (Oracle)", "contiguous-pow2": "Orca (Pow2)",
          "contiguous-max": "Orca (Max)"}
COLORS = {"paged": "#1f5fa8", "contiguous-oracle": "#e08020", "contiguous-pow2": "#7a9a30", "contiguous-max": "#b03030"}
SIM_NOTE = "simulated time: real scheduler + allocators, fixed measured step cost"


def _save(fig, folder: Path, name: str, rect: tuple[float, ...] = (0, 0, 1, 1)) -> None:
    fig.tight_layout(rect=rect)
    fig.savefig(folder / name, dpi=120)
    plt.close(fig)


def plot_breakdown(report: dict, folder: Path) -> None:
    """Fig. 2: share of the taken KV memory per allocator (stacked)."""
    workloads = list(report["saturated"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), sharey=True)
    for ax, workload in zip(axes, workloads):
        rows = report["saturated"][workload]
        names = list(rows)
        bottom = [0.0] * len(names)
        for key, label, color in PARTS:
            values = [100 * rows[a]["breakdown"][key] for a in names]
            ax.bar([LABELS[a] for a in names], values, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, values)]
        for i, a in enumerate(names):
            ax.text(i, 100 * rows[a]["breakdown"]["stored"] / 2, f"{rows[a]['breakdown']['stored']:.1%}",
                    ha="center", color="white", fontsize=9)
        ax.set_title(f"KV memory usage, {workload}-like")
        ax.tick_params(axis="x", labelrotation=20)
    axes[0].set_ylabel("Share of taken KV memory (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(PARTS), fontsize=9)
    _save(fig, folder, "fig2_memory_breakdown.png", rect=(0, 0.07, 1, 1))


def plot_batching(report: dict, folder: Path) -> None:
    """Average and peak number of batched requests per allocator."""
    workloads = list(report["saturated"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.6))
    for ax, workload in zip(axes, workloads):
        rows = report["saturated"][workload]
        names = list(rows)
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [rows[a]["mean_batch"] for a in names], 0.4, label="average", color="#1f5fa8")
        ax.bar([i + 0.2 for i in x], [rows[a]["peak_batch"] for a in names], 0.4, label="peak", color="#9ab8e0")
        ax.set_xticks(list(x), [LABELS[a] for a in names], rotation=20)
        ax.set_ylabel("# batched requests")
        ax.set_title(f"{workload}-like ({SIM_NOTE.split(':')[0]})")
    axes[0].legend()
    _save(fig, folder, "batched_requests.png")


def plot_latency(report: dict, folder: Path) -> None:
    """Fig. 12: normalized latency (s/token) vs request rate."""
    workloads = list(report["latency_curves"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.8))
    for ax, workload in zip(axes, workloads):
        for allocator, curve in report["latency_curves"][workload].items():
            rates, lats = zip(*curve)
            ax.plot(rates, lats, "o-", label=LABELS[allocator], color=COLORS[allocator])
            # The sustained (saturated) rate: where the queue starts growing without bound.
            ax.axvline(report["saturated"][workload][allocator]["sustained_rps"], color=COLORS[allocator], ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("Request rate (req/s, simulated time)")
        ax.set_ylabel("Normalized latency (s/token)")
        ax.set_title(f"{workload}-like")
    axes[0].legend(fontsize=8)
    _save(fig, folder, "fig12_normalized_latency.png")


def plot_prefix(report: dict, folder: Path) -> None:
    """Fig. 16: throughput with a shared few-shot prefix, with vs without prefix caching."""
    rows = report["prefix"]
    shots = list(rows)
    fig, ax = plt.subplots(figsize=(4.5, 3.8))
    x = range(len(shots))
    ax.bar([i - 0.2 for i in x], [rows[s]["rps_uncached"] for s in shots], 0.4, label="no prefix caching",
           color="#e08020")
    ax.bar([i + 0.2 for i in x], [rows[s]["rps_cached"] for s in shots], 0.4, label="prefix caching",
           color="#1f5fa8")
    for i, s in enumerate(shots):
        ax.text(i + 0.2, rows[s]["rps_cached"], f"{rows[s]['speedup']:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), [f"{s} ({rows[s]['prefix_len']} tok)" for s in shots])
    ax.set_ylabel("Throughput (req/s, simulated)")
    ax.margins(y=0.12)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    _save(fig, folder, "fig16_shared_prefix.png")


def _plot_saving(rows: list[dict], folder: Path, name: str, title: str, xlabel: str) -> None:
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.2), sharey=True)
    for ax, workload in zip(axes, workloads):
        mine = [r for r in rows if r["workload"] == workload]
        ax.bar([str(r["n"]) for r in mine], [100 * r["saving"] for r in mine], color="#1f5fa8")
        for i, r in enumerate(mine):
            ax.text(i, 100 * r["saving"], f"{r['saving']:.1%}", ha="center", va="bottom", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_title(f"{title}, {workload}-like")
    axes[0].set_ylabel("Memory saving (%)")
    _save(fig, folder, name)


def plot_sampling(report: dict, folder: Path) -> None:
    """Fig. 15 (left): share of KV blocks saved by sharing, parallel sampling."""
    _plot_saving(list(report["sampling"].values()), folder, "fig15_parallel_sampling.png", "Parallel sampling",
                 "# output sequences (n)")


def plot_beam_saving(report: dict, folder: Path) -> None:
    """Fig. 15 (right): share of KV blocks saved by sharing, beam search."""
    _plot_saving(list(report["beam_search"].values()), folder, "fig15_beam_search.png", "Beam search",
                 "beam width")


def plot_beam_rates(report: dict, folder: Path) -> None:
    """Fig. 14's claim as bars: sustained beam-search rate, paged vs Orca (Oracle), by beam width."""
    rows = report["beam_rates"]
    widths = list(rows)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    x = range(len(widths))
    ax.bar([i - 0.2 for i in x], [rows[w]["oracle_rps"] for w in widths], 0.4, label=LABELS["contiguous-oracle"],
           color=COLORS["contiguous-oracle"])
    ax.bar([i + 0.2 for i in x], [rows[w]["paged_rps"] for w in widths], 0.4, label=LABELS["paged"],
           color=COLORS["paged"])
    for i, w in enumerate(widths):
        ax.text(i + 0.2, rows[w]["paged_rps"], f"{rows[w]['ratio']:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), [f"{w}" if int(w) > 1 else "1 (greedy)" for w in widths])
    ax.set_xlabel("beam width (Alpaca-like)")
    ax.set_ylabel("Sustained rate (req/s, simulated)")
    ax.margins(y=0.12)
    ax.legend(fontsize=8)
    _save(fig, folder, "fig14_beam_search_rate.png")


def write_plots(report: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for plot in (plot_breakdown, plot_batching, plot_latency, plot_prefix, plot_sampling, plot_beam_saving,
                 plot_beam_rates):
        plot(report, folder)
