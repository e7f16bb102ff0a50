"""results.json -> the figures per workload and server (all rounds pooled) and README.md beside it.

Throughput is output tokens over benchmark time summed over the rounds (with the lowest and highest
single round); TTFT and TPOT means and p99s are over every successful request of every round.

    python -m benchmarks.report RESULTS_DIR      # rewrite README.md (and the plots) from results.json
    python -m benchmarks.report RUN.json ...     # print the figures of `pagedserve bench serve --result-json` runs
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

PEER_ORDER = ("pagedserve", "pagedserve-gguf", "llama.cpp", "transformers")


@dataclass(frozen=True, slots=True)
class Summary:
    runs: int
    output_tps: float
    output_tps_low: float
    output_tps_high: float
    ttft_ms: dict  # mean, p50, p90, p99
    tpot_ms: dict
    tokens_per_request: float  # output tokens each successful request produced, mean
    asked: int  # max_tokens
    failed: int
    goodput_fraction: Optional[float]  # requests meeting every SLO / all requests (SLO workloads only)


def _stats(values_ms: list[float]) -> dict:
    if not values_ms:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    array = np.asarray(values_ms, dtype=np.float64)
    p50, p90, p99 = np.percentile(array, (50, 90, 99))
    return {"mean": float(array.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _per_request(run: dict) -> tuple[list[float], list[float], list[int]]:
    """TTFTs and TPOTs (ms) and output lengths of the run's successful requests."""
    ttfts, tpots, lengths = [], [], []
    for ttft, latency, tokens, error in zip(
        run["ttfts_s"], run["latencies_s"], run["output_lens"], run["errors_per_request"]
    ):
        if error:
            continue
        ttfts.append(ttft * 1000.0)
        lengths.append(tokens)
        if tokens > 1:
            tpots.append((latency - ttft) / (tokens - 1) * 1000.0)
    return ttfts, tpots, lengths


def summarize(runs: list[dict]) -> dict[str, dict[str, Summary]]:
    """workload -> server -> its Summary, over the successful runs."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        if run.get("status") == "ok":
            groups.setdefault((run["workload"], run["server"]), []).append(run)
    table: dict[str, dict[str, Summary]] = {}
    for (workload, server), group in groups.items():
        ttfts, tpots, lengths = [], [], []
        for run in group:
            t, p, n = _per_request(run)
            ttfts += t
            tpots += p
            lengths += n
        per_round = [run["output_throughput"] for run in group]
        total_requests = sum(len(run["output_lens"]) for run in group)
        good = None
        if group[0].get("goodput_slos_ms"):
            good = sum(run["request_goodput"] * run["duration_s"] for run in group) / max(1, total_requests)
        table.setdefault(workload, {})[server] = Summary(
            runs=len(group),
            output_tps=sum(run["total_output_tokens"] for run in group) / sum(run["duration_s"] for run in group),
            output_tps_low=min(per_round),
            output_tps_high=max(per_round),
            ttft_ms=_stats(ttfts),
            tpot_ms=_stats(tpots),
            tokens_per_request=float(np.mean(lengths)) if lengths else 0.0,
            asked=group[0]["output_len"],
            failed=sum(run["failed"] for run in group),
            goodput_fraction=good,
        )
    return table


def _ordered(servers) -> list[str]:
    return sorted(servers, key=lambda s: (PEER_ORDER.index(s) if s in PEER_ORDER else len(PEER_ORDER), s))


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and np.isfinite(a) and np.isfinite(b) else "–"


def figures_table(results: dict) -> str:
    table = summarize(results["runs"])
    titles = {w["name"]: w["title"] for w in results["meta"]["workloads"]}
    lines = [
        "| workload | server | output tok/s (range over rounds) | TTFT mean / p99 (ms) | TPOT mean / p99 (ms) "
        "| tokens / request (asked) | goodput |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload in titles:
        for server in _ordered(table.get(workload, {})):
            s = table[workload][server]
            good = f"{100 * s.goodput_fraction:.0f}% of requests" if s.goodput_fraction is not None else ""
            failed = f", {s.failed} failed" if s.failed else ""
            spread = f" ({s.output_tps_low:.1f}–{s.output_tps_high:.1f})" if s.runs > 1 else ""
            lines.append(
                f"| {titles[workload]} | {server} | {s.output_tps:.1f}{spread} "
                f"| {s.ttft_ms['mean']:.0f} / {s.ttft_ms['p99']:.0f} | {s.tpot_ms['mean']:.1f} / {s.tpot_ms['p99']:.1f} "
                f"| {s.tokens_per_request:.1f} ({s.asked}{failed}) | {good} |"
            )
    return "\n".join(lines)


def ratios_table(results: dict) -> str:
    """pagedserve (each variant) / peer for each figure: above 1 is better for throughput, below 1 better for
    latencies."""
    table = summarize(results["runs"])
    titles = {w["name"]: w["title"] for w in results["meta"]["workloads"]}
    lines = [
        "| workload | ours / peer | output tok/s | TTFT mean | TTFT p99 | TPOT mean | TPOT p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload in titles:
        row = table.get(workload, {})
        for name in _ordered(s for s in row if s.startswith("pagedserve")):
            lines += _ratio_rows(titles[workload], name, row)
    return "\n".join(lines)


def _ratio_rows(title: str, name: str, row: dict) -> list[str]:
    ours, lines = row[name], []
    for peer in _ordered(s for s in row if not s.startswith("pagedserve")):
        theirs = row[peer]
        lines.append(
            f"| {title} | {name} / {peer} | **{_ratio(ours.output_tps, theirs.output_tps)}** "
            f"| {_ratio(ours.ttft_ms['mean'], theirs.ttft_ms['mean'])} "
            f"| {_ratio(ours.ttft_ms['p99'], theirs.ttft_ms['p99'])} "
            f"| {_ratio(ours.tpot_ms['mean'], theirs.tpot_ms['mean'])} "
            f"| {_ratio(ours.tpot_ms['p99'], theirs.tpot_ms['p99'])} |"
        )
    return lines


def machine_lines(meta: dict) -> list[str]:
    cpu = meta["cpu"]
    servers = "; ".join(
        f"{name}: " + ", ".join(f"{k} {v}" for k, v in versions.items()) for name, versions in meta["servers"].items()
    )
    loads = meta.get("load_average_range")
    lines = [
        f"- CPU: {cpu['model']}, {cpu['cores']} cores usable ({cpu['logical_cpus']} logical CPUs), "
        f"{cpu['memory_gib']} GiB; matrix path: **{cpu['isa']}** (flags: {', '.join(cpu['flags']) or 'none'})",
        f"- Date: {meta['date']}; rounds: {meta['rounds_done']} of {meta['rounds_planned']} "
        f"(servers alternating within every workload of every round){'; QUICK run (plumbing only)' if meta.get('quick') else ''}",
        f"- Versions: {servers}",
        f"- Model: the embedded SmolLM2-135M-Instruct: its Q4_1 GGUF for llama.cpp and pagedserve-gguf "
        f"(`--quantization gguf`: its Q4_1/Q8_0 blocks as stored); the same GGUF dequantized to {meta['dtype']} "
        "for pagedserve and transformers; temperature 0",
    ]
    if meta.get("poisson_rate"):
        lines.append(
            f"- Poisson workload: {meta['poisson_rate']:.2f} requests/s ({meta.get('poisson_rate_rule', '')}); "
            f"goodput SLOs: " + ", ".join(f"{k} <= {v:g} ms" for k, v in (meta.get("slos_ms") or {}).items())
        )
    if loads:
        lines.append(
            f"- Load average (1 min) before the runs: {loads[0]:.1f}–{loads[1]:.1f} on {cpu['cores']} cores "
            f"(near 0 on a quiet machine)"
        )
    lines.append(f"- Wall time: {meta.get('wall_s', 0) / 60:.1f} min")
    return lines + [f"- {note}" for note in meta.get("notes", [])]


def failures(results: dict) -> list[str]:
    return [
        f"- failed: {run['workload']} against {run['server']}, round {run['round']}: {run['error'][:300]}"
        for run in results["runs"]
        if run.get("status") != "ok"
    ]


def readme(results: dict, plots: list[str]) -> str:
    meta = results["meta"]
    parts = [
        f"# pagedserve and its peers, {meta['date']}, {meta['cpu']['model']} ({meta['cpu']['isa']})",
        "",
        *machine_lines(meta),
        *failures(results),
        "",
        "## Figures (all rounds pooled)",
        "",
        figures_table(results),
        "",
        "## Ratios, pagedserve / peer",
        "",
        "Throughput: above 1 means pagedserve is faster. Latencies: below 1 means pagedserve is quicker.",
        "",
        ratios_table(results),
        "",
        "How each server was asked: `ignore_eos` for pagedserve and llama.cpp (llama.cpp also with a -100 "
        "logit bias on the end-of-sequence tokens); `transformers serve` refuses `ignore_eos`, so every prompt "
        "ends in a counting task that keeps the model generating; the tokens column shows what each produced.",
        "",
        "Reproduce: `python -m benchmarks.peers` (see the top-level README).",
        "",
    ]
    if plots:
        parts += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    return "\n".join(parts)


BENCH_SERVE_KEYS = (
    "model",
    "dataset",
    "duration_s",
    "output_throughput",
    "total_output_tokens",
    "failed",
    "ttfts_s",
    "latencies_s",
    "output_lens",
    "errors_per_request",
)
"""What a `pagedserve bench serve --result-json` record holds that the figures need."""


def bench_serve_runs(paths: list[Path]) -> list[dict]:
    """`pagedserve bench serve --result-json` records as runs of this report: a workload per dataset and load
    shape, a server per `--label` (else the model). Raises ValueError naming a file that is not one."""
    runs = []
    for path in paths:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read {path}: {error}") from None
        missing = [key for key in BENCH_SERVE_KEYS if not isinstance(record, dict) or key not in record]
        if missing:
            raise ValueError(
                f"{path} is not a `pagedserve bench serve --result-json` file (no "
                f"{', '.join(missing)}); a directory of `python -m benchmarks.peers` holds results.json"
            )
        asked = record.get("max_tokens") or record["output_lens"]  # files written before max_tokens: what came
        runs.append(
            {
                **record,
                "status": "ok",
                "workload": _bench_serve_workload(record),
                "server": record.get("label") or record["model"],
                "output_len": round(float(np.mean(asked))) if asked else 0,
            }
        )
    return runs


def _bench_serve_workload(record: dict) -> str:
    rate = record.get("request_rate")
    shape = [f"{record['max_concurrency']} concurrent"] if record.get("max_concurrency") else []
    shape += [f"{rate:g} req/s"] if rate is not None and np.isfinite(rate) else []
    return f"{record['dataset']} ({', '.join(shape)})" if shape else record["dataset"]


def bench_serve_table(runs: list[dict]) -> str:
    workloads = [{"name": name, "title": name} for name in dict.fromkeys(run["workload"] for run in runs)]
    return figures_table({"runs": runs, "meta": {"workloads": workloads}})


def write(out_dir: Path, plots: list[str]) -> Path:
    results = json.loads((out_dir / "results.json").read_text())
    path = out_dir / "README.md"
    path.write_text(readme(results, plots))
    return path


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    usage = "\n".join(line.strip() for line in __doc__.strip().splitlines()[-2:])
    if not args:
        print(usage, file=sys.stderr)
        return 2
    paths = [Path(arg) for arg in args]
    if len(paths) == 1 and paths[0].is_dir():
        if not (paths[0] / "results.json").is_file():
            print(f"{paths[0]} has no results.json (python -m benchmarks.peers writes one)\n{usage}", file=sys.stderr)
            return 2
        from benchmarks.plot_runner import make_plots

        print(write(paths[0], make_plots(paths[0])).read_text())
        return 0
    try:
        runs = bench_serve_runs(paths)
    except ValueError as error:
        print(f"{error}\n{usage}", file=sys.stderr)
        return 2
    print(bench_serve_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
