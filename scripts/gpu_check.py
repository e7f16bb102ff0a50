#!/usr/bin/env python3
"""The GPU check: numerics, greedy tokens, throughput and single-stream decode on one GPU, as JSON.

    scripts/gpu_check.sh OUT_DIR                      # on a CUDA machine (installs carried wheels first)
    python scripts/gpu_check.py OUT_DIR --device cpu --quick   # every part on CPU, tiny shapes

Writes into OUT_DIR (at most 7 files):
    numerics.json       1. each GPU attention backend (triton, flash: those that load) vs torch, bf16
    greedy.json         2. greedy tokens of tiny random models, each backend and dtype vs the CPU engine in fp32
    single_stream.json  4. single-stream decode step vs the weight-read floor (0.6B shape; 8B time allowing)
    throughput.json     3. nano-vllm's workload on a Qwen3-0.6B-shaped random model: output tok/s, full-batch step
    environment.json    versions, the GPU, which backends load
    summary.json        each part's status and time, the headline figures next to the issue's targets
    gpu_check.log       everything printed

Each part runs in its own process with a deadline (a hung kernel or a CUDA fault ends that part only,
recorded in its JSON) and the whole check keeps within --budget-s (default 280 s on CUDA).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # engine/, scheduler/, tests/ of this checkout (scripts/ is sys.path[0])

from gpucheck.results import read_json, write_json  # noqa: E402 - after the path set-up

logger = logging.getLogger("gpu_check")
GRACE_S = 20  # a part past its deadline by this much is killed
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class Part:
    """One child run: `part` writes `file`; `cap` bounds its time, `least` is what it needs to start;
    `merge_key` names the entry it adds to a file another run wrote (the 8B run's)."""

    name: str
    part: str
    cap: float
    least: float
    options: dict = field(default_factory=dict)
    optional: bool = False  # "time allowing": nothing is reserved for it
    merge_key: Optional[str] = None

    @property
    def file(self) -> str:
        return f"{self.part}.json"


PLAN = (
    Part("environment", "environment", cap=40, least=5),
    Part("numerics", "numerics", cap=60, least=15),
    Part("greedy", "greedy", cap=60, least=20),
    Part("single_stream", "single_stream", cap=75, least=30, options={"models": ["qwen3-0.6b"]}),
    Part("throughput", "throughput", cap=180, least=60),
    Part("single_stream_8b", "single_stream", cap=150, least=80, optional=True, merge_key="llama-3.1-8b",
         options={"models": ["llama-3.1-8b"], "merge": True}),
)
RESULT_FILES = tuple(dict.fromkeys(p.file for p in PLAN)) + ("summary.json",)


# ---------------------------------------------------------------------- the parent: runs the parts

def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir).resolve()  # the children run from the repository root
    out.mkdir(parents=True, exist_ok=True)
    if args.part:
        return run_child(args, out)
    for stale in RESULT_FILES:  # an earlier run's results must not pass for this one's
        (out / stale).unlink(missing_ok=True)
    setup_logging(out / "gpu_check.log")
    budget = args.budget_s or (280.0 if args.device == "cuda" else 150.0)
    started = time.time()
    deadline = started + budget
    logger.info("GPU check: device %s%s, budget %.0f s, results in %s", args.device, " (quick)" if args.quick else "",
                budget, out)
    plan = [p for p in PLAN if selected(p, args)]
    statuses = {}
    work_dir = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=scratch_dir(args)))
    try:
        for index, part in enumerate(plan):
            reserve = sum(p.least for p in plan[index + 1:] if not p.optional)
            soft = min(time.time() + part.cap, deadline - reserve)
            blocked = blocker(out, args) if index else None
            if blocked or soft - time.time() < part.least:
                statuses[part.name] = record_skip(out, part, blocked or not_enough_time(part, soft))
                continue
            statuses[part.name] = run_part(args, out, work_dir, part, soft, hard=min(soft + GRACE_S, deadline + 5))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
        for tmp in out.glob("*.json.tmp"):  # a part killed mid-write
            tmp.unlink(missing_ok=True)
    summary = summarize(out, statuses, time.time() - started, args)
    write_json(out / "summary.json", summary)
    logger.info("summary: %s", json.dumps(summary["headline"], default=str))
    failed = [name for name, s in statuses.items() if s["status"] in ("error", "crashed", "timeout")]
    logger.info("done in %.0f s%s", time.time() - started, f"; failed: {', '.join(failed)}" if failed else "")
    return 1 if failed else 0


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="folder for the JSON results and the log (created)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and workloads (CPU testing)")
    parser.add_argument("--budget-s", type=float, default=None, help="the whole check's time (default 280 / 150)")
    parser.add_argument("--parts", default=None, help="comma-separated subset of: " + ", ".join(p.name for p in PLAN))
    parser.add_argument("--backends", default=None, help="attention backends to compare (default: triton,flash; "
                        "greedy adds torch; on CPU cpu too)")
    parser.add_argument("--throughput-backend", default=None, help="attention backend of parts 3-4 (default auto)")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child: run this part only
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def selected(part: Part, args: argparse.Namespace) -> bool:
    if part.name == "environment" or not args.parts:
        return True
    wanted = {name.strip() for name in args.parts.split(",")}
    return part.name in wanted or (part.name == "single_stream_8b" and "single_stream" in wanted)


def setup_logging(log_path: Optional[Path], timestamps: bool = True) -> None:
    """The parent logs to stdout and the log file, with times; a child to stdout (which the parent logs)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if log_path is not None:
        handlers.append(logging.FileHandler(log_path, mode="a"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s" if timestamps else "%(message)s",
                        datefmt="%H:%M:%S", handlers=handlers, force=True)


def run_part(args, out: Path, work_dir: Path, part: Part, soft: float, hard: float) -> dict:
    """Run one part in a child process, its output copied into the log; record a crash or a timeout."""
    options = dict(part.options)
    if args.backends:
        options["backends"] = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.throughput_backend:
        options["throughput_backend"] = args.throughput_backend
    command = [sys.executable, "-u", str(Path(__file__).resolve()), str(out), "--part", part.part, "--device",
               args.device, "--deadline", repr(soft), "--work-dir", str(work_dir), "--options", json.dumps(options)]
    if args.quick:
        command.append("--quick")
    env = {**os.environ, **CHILD_ENV}
    if args.device == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU tensors through its interpreter
    logger.info("=== %s (deadline in %.0f s)", part.name, soft - time.time())
    started = time.time()
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace", start_new_session=True)
    tail: list[str] = []
    pump = threading.Thread(target=copy_output, args=(child, part.name, tail), daemon=True)
    pump.start()
    try:
        returncode: Optional[int] = child.wait(timeout=max(hard - time.time(), 1))
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        returncode = None
    pump.join(timeout=5)
    seconds = round(time.time() - started, 1)
    if returncode == 0:
        data = read_json(out / part.file) or {}
        entry = data.get("models", {}).get(part.merge_key, {}) if part.merge_key else data
        status = entry.get("status", "error")
    else:
        status = "timeout" if returncode is None else "crashed"
        failure = {"status": status, "returncode": returncode, "output_tail": "".join(tail[-40:])[-6000:]}
        if returncode is None:
            failure["killed_after_s"] = seconds
        record_failure(out, part, failure)
    logger.info("=== %s: %s in %.1f s", part.name, status, seconds)
    return {"status": status, "seconds": seconds}


def copy_output(child: subprocess.Popen, name: str, tail: list[str]) -> None:
    for line in child.stdout:
        logger.info("[%s] %s", name, line.rstrip("\n"))
        tail.append(line)
        del tail[:-200]


def record_failure(out: Path, part: Part, failure: dict) -> None:
    """Keep what the part saved before it died; mark it with how it ended."""
    data = read_json(out / part.file) or {}
    if part.merge_key:
        data.setdefault("models", {})[part.merge_key] = {**data.get("models", {}).get(part.merge_key, {}), **failure}
    else:
        data.update(failure)
    write_json(out / part.file, data)


def scratch_dir(args) -> Optional[str]:
    """Where the random checkpoints go (16 GB for the 8B shape): /dev/shm when it has room (no disk in
    the way), else the default temporary directory."""
    if args.device == "cuda" and not args.quick and os.path.isdir("/dev/shm"):
        if shutil.disk_usage("/dev/shm").free > 40e9:
            return "/dev/shm"
    return None


def blocker(out: Path, args) -> Optional[str]:
    """Why no part can run here, as the environment part found (then they are skipped, not failed alike)."""
    environment = read_json(out / "environment.json") or {}
    if args.device == "cuda" and environment.get("cuda_available") is False:
        return "torch sees no CUDA device here"
    if environment.get("engine_import", "ok") != "ok":
        return f"the engine does not import here: {environment['engine_import']}"
    tail = environment.get("output_tail", "")
    if environment.get("status") == "crashed" and "ModuleNotFoundError" in tail:
        return "the check's Python lacks a module: " + next(
            line for line in tail.splitlines()[::-1] if "ModuleNotFoundError" in line)
    return None


def not_enough_time(part: Part, soft: float) -> str:
    return f"not enough time left ({max(soft - time.time(), 0):.0f} s, needs {part.least:.0f} s)"


def record_skip(out: Path, part: Part, reason: str) -> dict:
    logger.info("=== %s: skipped, %s", part.name, reason)
    record_failure(out, part, {"status": "skipped", "reason": reason})
    return {"status": "skipped", "seconds": 0.0}


# ---------------------------------------------------------------------- the summary

def summarize(out: Path, statuses: dict, total_s: float, args) -> dict:
    from gpucheck.summary import headline

    environment = read_json(out / "environment.json") or {}
    results = {name: read_json(out / f"{name}.json") or {} for name in ("numerics", "greedy", "throughput",
                                                                        "single_stream")}
    return {"device": args.device, "quick": args.quick, "total_s": round(total_s, 1), "parts": statuses,
            "headline": headline(results, on_gpu=args.device == "cuda" and not args.quick),
            "environment": environment}


# ---------------------------------------------------------------------- a child: one part

def run_child(args: argparse.Namespace, out: Path) -> int:
    for key, value in CHILD_ENV.items():
        os.environ.setdefault(key, value)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    setup_logging(None, timestamps=False)
    import faulthandler

    faulthandler.enable()  # a fatal signal prints every thread's stack into the log
    import torch

    from gpucheck.common import PartContext, error_record

    ctx = PartContext(name=args.part, out_dir=out, work_dir=Path(args.work_dir or tempfile.mkdtemp()),
                      device=torch.device(args.device), quick=args.quick,
                      deadline=args.deadline or time.time() + 600, options=json.loads(args.options))
    started = time.perf_counter()
    try:
        module = __import__(f"gpucheck.{args.part}", fromlist=["run"])
        module.run(ctx)
    except Exception as exc:  # noqa: BLE001 - a part's failure is its result, the check goes on
        ctx.result.update(error_record(exc))
    ctx.result.setdefault("status", "ok")
    ctx.result["seconds"] = round(time.perf_counter() - started, 1)
    ctx.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
