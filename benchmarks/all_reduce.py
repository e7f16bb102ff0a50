"""What one all-reduce of tensor parallelism costs between processes of this host: gloo (loopback TCP) against
the shared-memory all-reduce (`engine/distributed/shm_all_reduce.py`): `python -m benchmarks.all_reduce`.

    python -m benchmarks.all_reduce [--ranks 2] [--rows 1,16] [--hidden 2048] [--dtype bfloat16] [--calls 2000]
    python -m benchmarks.all_reduce --collective all_gather --hidden 4096    # vocab-parallel logits' gather

Each rank is a spawned process with one torch thread, pinned to its share of the CPUs as the engine pins its
ranks (`engine/distributed/cpu_binding.py`); all ranks call the all-reduce back to back, `--calls` times per
round, rounds alternating between the transports; rank 0 times each call (`time.perf_counter`) and each
transport keeps its best round's median (and that round's p99). A [rows, hidden] tensor is what a decode step
of `rows` requests all-reduces twice per layer; with `--collective all_gather`, a [rows, vocab / ranks] one is
each rank's slice of the step's logits (vocab 8192 on two ranks: --hidden 4096).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import time
from multiprocessing.queues import Queue
from typing import Optional, Sequence

import torch

from benchmarks.machine import cpu_info
from engine.cpu_threads import machine_cpu_threads
from engine.distributed.cpu_binding import pin_process, plan_rank_cpus, process_cpus
from engine.distributed.parallel_group import ParallelGroup
from engine.distributed.shm_all_reduce import AllReduceHandle, ShmAllReduce


def _rank(rank: int, args: argparse.Namespace, port: int, handle: AllReduceHandle, results: Queue) -> None:
    share = plan_rank_cpus(process_cpus(), args.ranks, machine_cpu_threads(None, os.environ).count)[rank]
    if share.cpus is not None:
        pin_process(share.cpus)
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    shm = ParallelGroup.join(rank, args.ranks, f"tcp://127.0.0.1:{port}", cpu, 60, handle)
    transports = {"gloo": ParallelGroup(rank, args.ranks), "shm": shm}
    dtype = getattr(torch, args.dtype)
    report: dict[str, dict[str, float]] = {}
    try:
        for rows in args.rows:
            tensor = torch.randn(rows, args.hidden).to(dtype)
            best: dict[str, tuple[float, float]] = {}
            for _ in range(args.rounds):
                for name, group in transports.items():
                    collective = getattr(group, args.collective)
                    for _ in range(50):  # warm-up
                        collective(tensor)
                    timings = []
                    for _ in range(args.calls):
                        start = time.perf_counter()
                        collective(tensor)
                        timings.append(time.perf_counter() - start)
                    timings.sort()
                    median, p99 = statistics.median(timings), timings[int(len(timings) * 0.99)]
                    if name not in best or median < best[name][0]:
                        best[name] = (median, p99)
                    tensor.div_(args.ranks)  # keep the values from growing round to round
            for name, (median, p99) in best.items():
                report[f"{rows}x{args.hidden} {name}"] = {"median_us": median * 1e6, "p99_us": p99 * 1e6}
    finally:
        shm.leave()
    if rank == 0:
        results.put(report)


def run(args: argparse.Namespace) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with ShmAllReduce.create(args.ranks, timeout_s=60) as owner:
        procs = [
            context.Process(target=_rank, args=(rank, args, port, owner.handle, results)) for rank in range(args.ranks)
        ]
        for proc in procs:
            proc.start()
        try:
            timings = results.get(timeout=600)
        finally:
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    return {
        "machine": cpu_info(),
        "collective": args.collective,
        "ranks": args.ranks,
        "dtype": args.dtype,
        "calls": args.calls,
        "timings": timings,
    }


def print_report(report: dict) -> None:
    machine = report["machine"]
    print(
        f"CPU: {machine['model']} ({machine['cores']} cores usable; {', '.join(machine['flags'])}); "
        f"{report['collective']}, {report['ranks']} ranks, {report['dtype']}, {report['calls']} calls per round"
    )
    for name, row in report["timings"].items():
        print(f"{name}: median {row['median_us']:.1f} us, p99 {row['p99_us']:.1f} us")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--collective", default="all_reduce", choices=("all_reduce", "all_gather"))
    parser.add_argument("--rows", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--calls", type=int, default=2000, help="calls timed per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the report as JSON as well")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    report = run(args)
    print_report(report)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
