"""The peers run where users run it: long prompts and long contexts, a busy neighbour, a 1-CPU quota. pagedserve
(on the embedded GGUF's own blocks) against llama.cpp's server on the same file, then a Markdown table and plots.

    python -m benchmarks.peers_field                       # 1,024 / 4,149 / 16,000-token prompts, then the CPU cases
    python -m benchmarks.peers_field --prompt-tokens 1024 --rounds 1 --requests 2   # a quick check of the plumbing

Two parts, each the command that measures it alone (its docstring says how):
- long prompts (`benchmarks.long_context`): one streamed request per length on a server started for that
  length: time to first token (the prefill) and the TPOT of the decode at that context. Past the trained 8,192
  positions both serve YaRN: pagedserve through `--hf-overrides`, llama.cpp through its rope flags on a copy of
  the GGUF whose context_length says the length.
- a shared or CPU-limited machine (`benchmarks.shared_cpu`): single-stream TPOT quiet, with one busy neighbour
  process pinned to one of the CPUs, and inside a 1-CPU cgroup quota (an affinity mask where no cgroup can be
  made: said so); slowdowns against each server's own quiet figure.
Output: benchmarks/results/<date>-<cpu>-field/ (`--out` to change): results.json, README.md, long_context.png and
shared_cpu.png. Benchmark alone: a second busy process on the machine is the neighbour case everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import long_context, shared_cpu
from benchmarks.machine import cpu_info
from benchmarks.peers import fresh_results_dir
from benchmarks.plot_runner import WORK_DIR, make_plots
from benchmarks.servers import REPO

CASES = ("quiet", "neighbour", "quota")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.peers_field",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--prompt-tokens", default="1024,4149,16000", help="prompt lengths, comma-separated ('' skips)")
    p.add_argument("--tokens", type=int, default=32, help="output tokens per long-prompt request")
    p.add_argument("--rounds", type=int, default=1, help="rounds of each part (servers alternate within each)")
    p.add_argument("--requests", type=int, default=3, help="CPU cases: sequential requests per figure (median)")
    p.add_argument("--cpu-tokens", type=int, default=64, help="CPU cases: tokens per request")
    p.add_argument("--no-cpu-cases", action="store_true", help="leave the shared-CPU and 1-CPU-quota cases out")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per long-prompt request")
    p.add_argument("--out", type=Path, default=None)
    return p


def cpu_cases(args: argparse.Namespace) -> dict:
    """{server: {case: median TPOT ms, case_load: the highest load average before it}, confinement}."""
    cpu_args = shared_cpu.build_parser().parse_args(
        ["--rounds", str(args.rounds), "--requests", str(args.requests), "--tokens", str(args.cpu_tokens)]
    )
    log_dir = WORK_DIR / "logs" / time.strftime("field-cpu-%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    runs, confinement = shared_cpu.run_rounds(cpu_args, CASES, log_dir)
    servers = {}
    for name, rounds in runs.items():
        figures = {}
        for case in CASES:
            figures[case] = round(statistics.median(r[case][0] for r in rounds), 2)
            figures[f"{case}_load"] = round(max(r[case][1] for r in rounds), 2)
        # "pagedserve default" (shared_cpu's variant name) is the server as users start it
        servers["pagedserve" if name == "pagedserve default" else name] = figures
    return {"servers": servers, "confinement": confinement}


def write_readme(out_dir: Path, results: dict, plots: list[str]) -> Path:
    meta = results["meta"]
    cpu = meta["cpu"]
    lines = [
        f"# pagedserve and llama.cpp where users run them, {meta['date']}, {cpu['model']} ({cpu['isa']})",
        "",
        f"- CPU: {cpu['model']}, {cpu['cores']} usable CPUs; flags: {', '.join(cpu['flags'])}",
        "- Model: the embedded SmolLM2-135M-Instruct Q4_1 GGUF for both (pagedserve `--quantization gguf`)",
        f"- Rounds: {meta['rounds']}; load average before the run: {meta['load_before']}",
        f"- Command: `{meta['command']}`; wall time {meta['wall_min']} min",
        "",
    ]
    rows = results.get("long_context") or []
    if rows:
        lines += [
            "## Long prompts: one streamed request, fresh server per length",
            "",
            "| prompt tokens | pagedserve TTFT (s) | llama.cpp TTFT (s) | TTFT ratio | pagedserve TPOT (ms) "
            "| llama.cpp TPOT (ms) | TPOT ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            ours, theirs = row["pagedserve"], row.get("llama.cpp", {})
            lines.append(
                f"| {row['prompt_tokens']:,} | {ours['ttft_s']:.2f} | {theirs.get('ttft_s', float('nan')):.2f} "
                f"| **{row.get('ttft_ratio', float('nan')):.3f}x** | {ours['tpot_ms']:.1f} "
                f"| {theirs.get('tpot_ms', float('nan')):.1f} | **{row.get('tpot_ratio', float('nan')):.3f}x** |"
            )
        lines += ["", "Ratios pagedserve / llama.cpp: below 1 means pagedserve is quicker.", ""]
    cpu_part = results.get("cpu_cases")
    if cpu_part:
        lines += [
            f"## Single-stream TPOT on a shared machine (1-CPU case: {cpu_part['confinement']})",
            "",
            "| server | quiet (ms) | one busy neighbour (ms) | slowdown | 1-CPU quota (ms) | slowdown |",
            "|---|---|---|---|---|---|",
        ]
        for name, f in cpu_part["servers"].items():
            lines.append(
                f"| {name} | {f['quiet']:.1f} | {f['neighbour']:.1f} | **{f['neighbour'] / f['quiet']:.2f}x** "
                f"| {f['quota']:.1f} | **{f['quota'] / f['quiet']:.2f}x** |"
            )
        lines.append("")
    lines += [f"![{name}]({name})" for name in plots]
    path = out_dir / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    cpu = cpu_info()
    out_dir = args.out or fresh_results_dir(REPO / "benchmarks" / "results", cpu, "-field")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu['model']} ({cpu['isa']}), {cpu['cores']} cores; results to {out_dir}", flush=True)
    results: dict = {
        "meta": {
            "date": date.today().isoformat(),
            "cpu": cpu,
            "rounds": args.rounds,
            "load_before": round(os.getloadavg()[0], 2),
            "command": " ".join(["python -m benchmarks.peers_field", *(argv if argv is not None else sys.argv[1:])]),
        }
    }
    lengths = [int(n) for n in args.prompt_tokens.split(",") if n.strip()]
    if lengths:
        results["long_context"] = long_context.run_lengths(
            lengths, args.tokens, args.rounds, ["pagedserve", "llama.cpp"], args.timeout_s
        )
        (out_dir / "results.json").write_text(json.dumps(results, indent=2))  # kept if the CPU cases fail
    if not args.no_cpu_cases:
        results["cpu_cases"] = cpu_cases(args)
    results["meta"]["wall_min"] = round((time.monotonic() - started) / 60, 1)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    readme = write_readme(out_dir, results, make_plots(out_dir, "benchmarks.field_plots"))
    print("\n" + readme.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
