#!/usr/bin/env python3
"""The GPU check: tests/gpu, attention numerics, greedy tokens, then single-stream decode and throughput on
one GPU, as one JSON file.

    scripts/gpu_check.sh OUT_DIR                      # on a CUDA machine (installs carried wheels first)
    python scripts/gpu_check.py OUT_DIR --device cpu --quick   # every part on CPU, tiny shapes

Correctness first, then speed; each part's results go into OUT_DIR/results.json (rewritten after
every part, so a check cut short still leaves what ran):
    environment     versions (both flash-attn generations), the GPU, which backends load
    tests_gpu       every tests/gpu test by pytest: outcome, skip reason, duration, failure text
    numerics        each GPU attention backend (triton, flash-attn 4 and 2 on their own) vs torch, bf16
    greedy          greedy tokens of tiny random models, each backend and dtype vs the CPU engine in fp32
                    (itself vs HF transformers), and CUDA graphs vs eager steps
    single_stream   single-stream decode step vs the weight-read floor (0.6B shape; 8B time allowing)
    throughput      nano-vllm's workload on a Qwen3-0.6B-shaped random model: output tok/s, full-batch step
and `summary` (each part's status and time, the headline figures next to the issue's targets).
OUT_DIR also gets gpu_check.log (everything printed); --keep-parts keeps each part's own JSON in
OUT_DIR/parts.

Each part runs in its own process group under a deadline (a hung kernel or a CUDA fault ends that
part only, recorded in its results); the whole check keeps within --budget-s (by default the parts'
caps added up, and some slack). No part outlives the check: a part past its deadline,
and the running part when the check exits or gets SIGTERM/SIGINT, is killed with its whole group.
"""

from __future__ import annotations

import argparse
import atexit
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
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # engine/, scheduler/, tests/ of this checkout (scripts/ is sys.path[0])

from gpucheck.results import read_json, write_json  # noqa: E402 - after the path set-up

logger = logging.getLogger("gpu_check")
GRACE_S = 15  # a part past its deadline by this much is killed
STOP_WAIT_S = 5  # after SIGTERM, how long a part may take to save and exit before SIGKILL
RESULTS = "results.json"
CHILD_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "PYTHONUNBUFFERED": "1",
}


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


# Caps in seconds, each part's child start-up included: the required parts' add up to 380, inside the
# 400 s default budget on CUDA (gpu_check.sh's wheel install comes before it: the whole stays under
# 8 minutes); the optional 8B run gets what the others leave.
PLAN = (
    Part("environment", "environment", cap=25, least=5),
    Part("tests_gpu", "tests_gpu", cap=120, least=30),
    Part("numerics", "numerics", cap=45, least=15),
    Part("greedy", "greedy", cap=60, least=20),
    Part("single_stream", "single_stream", cap=40, least=25, options={"models": ["qwen3-0.6b"]}),
    Part("throughput", "throughput", cap=90, least=45),
    Part(
        "single_stream_8b",
        "single_stream",
        cap=90,
        least=60,
        optional=True,
        merge_key="llama-3.1-8b",
        options={"models": ["llama-3.1-8b"], "merge": True},
    ),
)
PART_FILES = tuple(dict.fromkeys(p.file for p in PLAN))
FAILED = ("error", "failed", "crashed", "timeout", "interrupted")


# ---------------------------------------------------------------------- the parent: runs the parts


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir).resolve()  # the children run from the repository root
    out.mkdir(parents=True, exist_ok=True)
    if args.part:
        return run_child(args, out)
    (out / RESULTS).unlink(missing_ok=True)  # an earlier run's results must not pass for this one's
    shutil.rmtree(out / "parts", ignore_errors=True)
    if not args.append_log:  # gpu_check.sh starts the log with what it installed
        (out / "gpu_check.log").unlink(missing_ok=True)
    setup_logging(out / "gpu_check.log")
    budget = args.budget_s or (400.0 if args.device == "cuda" else 150.0)
    check = Check(args, out, budget)
    logger.info(
        "GPU check (pid %d): device %s%s, budget %.0f s, results in %s",
        os.getpid(),
        args.device,
        " (quick)" if args.quick else "",
        budget,
        out / RESULTS,
    )
    with check.stopping_children():
        check.run()
    failed = [name for name, s in check.statuses.items() if s["status"] in FAILED]
    logger.info("done in %.0f s%s", time.time() - check.started, f"; failed: {', '.join(failed)}" if failed else "")
    return 1 if failed else 0


class Check:
    """The parent's state: the plan, each part's status, the part running now, and the one results file."""

    def __init__(self, args: argparse.Namespace, out: Path, budget: float):
        self.args, self.out, self.budget = args, out, budget
        self.started = time.time()
        self.deadline = self.started + budget
        self.plan = [p for p in PLAN if selected(p, args)]
        self.statuses: dict[str, dict] = {}
        self.work_dir = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=scratch_dir(args)))
        self.parts_dir = self.work_dir / "parts"  # each part's own file: intermediates, merged into RESULTS
        self.parts_dir.mkdir()
        self.child: Optional[subprocess.Popen] = None
        self.interrupted: Optional[str] = None

    def run(self) -> None:
        try:
            self.write_results()
            for index, part in enumerate(self.plan):
                if self.interrupted:
                    self.statuses[part.name] = record_skip(self.parts_dir, part, f"not run: {self.interrupted}")
                    continue
                reserve = sum(p.least for p in self.plan[index + 1 :] if not p.optional)
                soft = min(time.time() + part.cap, self.deadline - reserve)
                blocked = blocker(self.parts_dir, self.args) if index else None
                if blocked or soft - time.time() < part.least:
                    self.statuses[part.name] = record_skip(self.parts_dir, part, blocked or not_enough_time(part, soft))
                else:
                    hard = min(soft + GRACE_S, self.deadline + 5)
                    self.statuses[part.name] = run_part(self, part, soft, hard)
                self.write_results()
        finally:
            self.write_results(final=True)
            if self.args.keep_parts:
                shutil.copytree(self.parts_dir, self.out / "parts", dirs_exist_ok=True)
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def write_results(self, final: bool = False) -> None:
        """RESULTS: the check's settings, the summary, the environment and every part's results so far."""
        results = collect_results(self.parts_dir)
        summary = summarize(results, self.statuses, time.time() - self.started, self.args)
        write_json(
            self.out / RESULTS,
            {
                "check": {
                    "device": self.args.device,
                    "quick": self.args.quick,
                    "budget_s": self.budget,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
                    "elapsed_s": round(time.time() - self.started, 1),
                    "finished": final and not self.interrupted,
                    "interrupted": self.interrupted,
                },
                "summary": summary,
                "environment": results.get("environment", {}),
                "parts": {name: data for name, data in results.items() if name != "environment"},
            },
        )
        if final:
            logger.info("summary: %s", json.dumps(summary["headline"], default=str))

    @contextmanager
    def stopping_children(self):
        """SIGTERM/SIGINT stop the running part (its whole group) and the parts after it, and the results
        are still written; on any exit of this process a part still running is killed."""

        def on_signal(signum, frame):  # only flags and signals: the main loop waits and escalates
            self.interrupted = f"the check got {signal.Signals(signum).name}"
            if self.child is not None:
                with suppress(ProcessLookupError):
                    os.killpg(self.child.pid, signal.SIGTERM)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        atexit.register(stop_child, lambda: self.child)
        try:
            yield
        finally:
            stop_child(self.child)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="folder for the JSON results and the log (created)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and workloads (CPU testing)")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="the whole check's time (default 400 on CUDA, 150 on CPU)"
    )
    parser.add_argument("--keep-parts", action="store_true", help="keep each part's own JSON in OUT_DIR/parts")
    parser.add_argument("--parts", default=None, help="comma-separated subset of: " + ", ".join(p.name for p in PLAN))
    parser.add_argument(
        "--backends",
        default=None,
        help="attention backends to compare (default: triton,flash; greedy adds torch; on CPU cpu too)",
    )
    parser.add_argument(
        "--throughput-backend", default=None, help="attention backend of the speed parts (default auto)"
    )
    parser.add_argument("--append-log", action="store_true", help=argparse.SUPPRESS)
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
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(message)s" if timestamps else "%(message)s",
        datefmt="%H:%M:%S",
        handlers=handlers,
        force=True,
    )


def run_part(check: Check, part: Part, soft: float, hard: float) -> dict:
    """Run one part in a child process (its own process group), its output copied into the log; record a
    crash, a timeout or an interruption."""
    args = check.args
    options = dict(part.options)
    if args.backends:
        options["backends"] = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.throughput_backend:
        options["throughput_backend"] = args.throughput_backend
    command = [
        sys.executable,
        "-u",
        str(Path(__file__).resolve()),
        str(check.parts_dir),
        "--part",
        part.part,
        "--device",
        args.device,
        "--deadline",
        repr(soft),
        "--work-dir",
        str(check.work_dir),
        "--options",
        json.dumps(options),
    ]
    if args.quick:
        command.append("--quick")
    env = {**os.environ, **CHILD_ENV}
    if args.device == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU tensors through its interpreter
    started = time.time()
    # Its own process group, so that it and anything it starts are killed together; the same session,
    # so that whatever ends this check's session ends it too.
    child = check.child = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        **own_group(),
    )
    note_child(child.pid)
    logger.info("=== %s (deadline in %.0f s, process group %d)", part.name, soft - time.time(), child.pid)
    tail: list[str] = []
    pump = threading.Thread(target=copy_output, args=(child, part.name, tail), daemon=True)
    pump.start()
    returncode: Optional[int] = None
    try:
        while returncode is None and time.time() < hard and not check.interrupted:
            try:
                returncode = child.wait(timeout=min(1.0, max(hard - time.time(), 0.01)))
            except subprocess.TimeoutExpired:
                pass
    finally:
        stop_child(child)  # its group: what the part started too, and all of it past the deadline
        check.child = None
        note_child(None)
    pump.join(timeout=5)
    seconds = round(time.time() - started, 1)
    if returncode == 0 and not check.interrupted:
        data = read_json(check.parts_dir / part.file) or {}
        entry = data.get("models", {}).get(part.merge_key, {}) if part.merge_key else data
        status = entry.get("status", "error")
    else:
        status = "interrupted" if check.interrupted else "timeout" if returncode is None else "crashed"
        failure = {"status": status, "returncode": returncode, "output_tail": "".join(tail[-40:])[-6000:]}
        if returncode is None:
            failure["killed_after_s"] = seconds
        record_failure(check.parts_dir, part, failure)
    logger.info("=== %s: %s in %.1f s", part.name, status, seconds)
    return {"status": status, "seconds": seconds}


def own_group() -> dict:
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}


def stop_child(child) -> None:
    """SIGTERM to the part's process group while the part runs, then, STOP_WAIT_S later at most, SIGKILL to
    the group: whatever the part started goes with it. `child` may be a callable giving it."""
    child = child() if callable(child) else child
    if child is None:
        return
    try:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(child.pid, signal.SIGKILL)  # what the part started and left behind, too
    except ProcessLookupError:
        return
    child.wait()


def note_child(pid: Optional[int]) -> None:
    """Tell gpu_check.sh which process group runs now (GPU_CHECK_CHILD_FILE), so that it can kill the group
    even when this process is SIGKILLed."""
    path = os.environ.get("GPU_CHECK_CHILD_FILE")
    if path:
        Path(path).write_text(f"{pid}\n" if pid else "")


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
            line for line in tail.splitlines()[::-1] if "ModuleNotFoundError" in line
        )
    return None


def not_enough_time(part: Part, soft: float) -> str:
    return f"not enough time left ({max(soft - time.time(), 0):.0f} s, needs {part.least:.0f} s)"


def record_skip(out: Path, part: Part, reason: str) -> dict:
    logger.info("=== %s: skipped, %s", part.name, reason)
    record_failure(out, part, {"status": "skipped", "reason": reason})
    return {"status": "skipped", "seconds": 0.0}


# ---------------------------------------------------------------------- the results


def collect_results(parts_dir: Path) -> dict[str, dict]:
    """Each part's results by name (single_stream holds the 8B run's too)."""
    return {
        file.removesuffix(".json"): read_json(parts_dir / file) or {}
        for file in PART_FILES
        if (parts_dir / file).exists()
    }


def summarize(results: dict[str, dict], statuses: dict, total_s: float, args) -> dict:
    from gpucheck.summary import headline

    parts = {name: results.get(name, {}) for name in ("tests_gpu", "numerics", "greedy", "throughput", "single_stream")}
    return {
        "device": args.device,
        "quick": args.quick,
        "total_s": round(total_s, 1),
        "parts": statuses,
        "headline": headline(parts, on_gpu=args.device == "cuda" and not args.quick),
    }


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

    ctx = PartContext(
        name=args.part,
        out_dir=out,
        work_dir=Path(args.work_dir or tempfile.mkdtemp()),
        device=torch.device(args.device),
        quick=args.quick,
        deadline=args.deadline or time.time() + 600,
        options=json.loads(args.options),
    )
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
