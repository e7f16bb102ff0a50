"""PNG plots from results.json (matplotlib; needs only it and numpy, so it runs in the benchmark's own venv
when the pagedserve one has no matplotlib):

    throughput_vs_concurrency.png   output tok/s against concurrency (1, 16, 64) per server, rounds' range
    latency_percentiles.png         TTFT and TPOT mean / p50 / p90 / p99 per workload and server

    python -m benchmarks.plots RESULTS_DIR     # prints the file names written
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.report import _ordered, summarize  # noqa: E402

COLORS = {"pagedserve": "#1f77b4", "pagedserve-gguf": "#17becf", "llama.cpp": "#ff7f0e", "transformers": "#2ca02c"}


def save_figure(fig, out_dir: Path, name: str, dpi: int) -> str:
    """`fig` laid out, written to out_dir/name and closed; its file name."""
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=dpi)
    plt.close(fig)
    return name


def _subtitle(meta: dict) -> str:
    cpu = meta["cpu"]
    return f"{cpu['model']} ({cpu['isa']}), {cpu['cores']} cores, {meta['date']}, {meta['rounds_done']} round(s)"


def throughput_plot(results: dict, out_dir: Path) -> str:
    table = summarize(results["runs"])
    concurrency = {
        w["name"]: w["max_concurrency"]
        for w in results["meta"]["workloads"]
        if w["max_concurrency"] and not w["prefix_len"] and w["request_rate"] is None
    }
    fig, ax = plt.subplots(figsize=(7, 4.5))
    servers = _ordered({s for w in concurrency for s in table.get(w, {})})
    for server in servers:
        points = sorted((concurrency[w], table[w][server]) for w in concurrency if server in table.get(w, {}))
        if not points:
            continue
        xs = [c for c, _ in points]
        ys = [s.output_tps for _, s in points]
        errors = np.array(
            [
                [s.output_tps - s.output_tps_low for _, s in points],
                [s.output_tps_high - s.output_tps for _, s in points],
            ]
        ).clip(min=0)
        ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=4, label=server, color=COLORS.get(server))
    ax.set_xscale("log", base=2)
    ax.set_xticks([c for c in sorted(set(concurrency.values()))])
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("Throughput vs concurrency (random 128-token prompts)\n" + _subtitle(results["meta"]), fontsize=10)
    return save_figure(fig, out_dir, "throughput_vs_concurrency.png", 110)


def latency_plot(results: dict, out_dir: Path) -> str:
    table = summarize(results["runs"])
    workloads = [w for w in results["meta"]["workloads"] if w["name"] in table]
    stats = ("mean", "p50", "p90", "p99")
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 2.6 * len(workloads) + 0.8), squeeze=False)
    for row, workload in enumerate(workloads):
        servers = _ordered(table[workload["name"]])
        width = 0.8 / max(1, len(servers))
        for col, (metric, label) in enumerate((("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"))):
            ax = axes[row][col]
            for i, server in enumerate(servers):
                values = [getattr(table[workload["name"]][server], metric)[s] for s in stats]
                ax.bar(
                    np.arange(len(stats)) + (i - (len(servers) - 1) / 2) * width,
                    values,
                    width,
                    label=server,
                    color=COLORS.get(server),
                )
            ax.set_xticks(np.arange(len(stats)), stats)
            ax.set_ylabel(label)
            ax.set_title(workload["title"], fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Latency percentiles per workload (all rounds pooled)\n" + _subtitle(results["meta"]), fontsize=10)
    return save_figure(fig, out_dir, "latency_percentiles.png", 100)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out_dir = Path(args[0])
    results = json.loads((out_dir / "results.json").read_text())
    for name in (throughput_plot(results, out_dir), latency_plot(results, out_dir)):
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
