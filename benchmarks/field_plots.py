"""PNG plots of a `benchmarks.peers_field` results folder (matplotlib and numpy only, like benchmarks/plots.py):

long_context.png   TTFT and decode TPOT against the prompt's length, per server (log-log)
shared_cpu.png     single-stream TPOT quiet / one busy neighbour / 1-CPU quota per server, slowdowns marked

python -m benchmarks.field_plots RESULTS_DIR     # prints the file names written
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.plots import COLORS, save_figure  # noqa: E402

COLORS_HERE = {**COLORS, "pagedserve": COLORS["pagedserve-gguf"]}  # pagedserve runs the GGUF's blocks here


def _subtitle(meta: dict) -> str:
    cpu = meta["cpu"]
    return f"{cpu['model']} ({cpu['isa']}), {cpu['cores']} cores, {meta['date']}, embedded Q4_1 GGUF"


def long_context_plot(results: dict, out_dir: Path) -> str:
    rows = results["long_context"]
    servers = [s for s in ("pagedserve", "llama.cpp") if any(s in row for row in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
    for ax, (metric, label) in zip(axes, (("ttft_s", "time to first token (s)"), ("tpot_ms", "decode TPOT (ms)"))):
        for server in servers:
            points = [(row["prompt_tokens"], row[server][metric]) for row in rows if server in row]
            ax.plot(*zip(*points), marker="o", label=server, color=COLORS_HERE.get(server))
            for x, y in points:
                ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens (context of the decode)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle("Long prompts, one request at a time\n" + _subtitle(results["meta"]), fontsize=10)
    return save_figure(fig, out_dir, "long_context.png", 110)


def shared_cpu_plot(results: dict, out_dir: Path) -> str:
    part = results["cpu_cases"]
    cases = (("quiet", "quiet"), ("neighbour", "one busy neighbour"), ("quota", "1-CPU quota"))
    servers = list(part["servers"])
    width = 0.8 / max(1, len(servers))
    fig, ax = plt.subplots(figsize=(7.5, 4.3))
    for i, server in enumerate(servers):
        figures = part["servers"][server]
        xs = np.arange(len(cases)) + (i - (len(servers) - 1) / 2) * width
        values = [figures[case] for case, _ in cases]
        ax.bar(xs, values, width, label=server, color=COLORS_HERE.get(server))
        for x, (case, _), value in zip(xs, cases, values):
            text = f"{value:.1f}" if case == "quiet" else f"{value:.1f}\n{value / figures['quiet']:.2f}x"
            ax.annotate(text, (x, value), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    top = max(f[case] for f in part["servers"].values() for case, _ in cases)
    ax.set_ylim(0, top * 1.18)  # room for the labels over the tallest bar
    ax.set_xticks(np.arange(len(cases)), [label for _, label in cases])
    ax.set_ylabel("single-stream TPOT (ms), lower is better")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(
        f"A shared or CPU-limited machine (1-CPU case: {part['confinement']})\n" + _subtitle(results["meta"]),
        fontsize=9,
    )
    return save_figure(fig, out_dir, "shared_cpu.png", 110)


PLOTS = (("long_context", long_context_plot), ("cpu_cases", shared_cpu_plot))
"""What results.json holds and the plot drawn from it."""


def main(argv=None) -> int:
    out_dir = Path((sys.argv[1:] if argv is None else argv)[0])
    results = json.loads((out_dir / "results.json").read_text())
    drawn = [draw(results, out_dir) for key, draw in PLOTS if results.get(key)]
    print("\n".join(drawn))
    return 0


if __name__ == "__main__":
    sys.exit(main())
