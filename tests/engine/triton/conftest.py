"""The Triton kernels run on CPU tensors through Triton's interpreter here (on a CUDA machine, compiled on the GPU).

Triton reads TRITON_INTERPRET when it is imported (its own library functions are decorated then),
when our kernels are decorated (at import of engine.kernels.triton) and when they first run. So this
conftest sets it while importing both, and the autouse fixture sets it again around each test of
this folder: the rest of the suite runs with the environment it had.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def _import_interpreted() -> str | None:
    """Import triton and the kernels under TRITON_INTERPRET=1; the reason when that came too late."""
    already = "triton" in sys.modules
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from engine.kernels.triton.paged_kv import is_interpreted
        from engine.kernels.triton.paged_prefill import _prefill_kernel
    except ImportError:
        return None  # a broken triton: the test module's importorskip says why
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    if not is_interpreted(_prefill_kernel):
        return "engine.kernels.triton was imported before TRITON_INTERPRET=1 was set (compiled kernels, no GPU)"
    if already:
        return None if _stdlib_interpreted() else "triton was imported before TRITON_INTERPRET=1 was set"
    return None


def _stdlib_interpreted() -> bool:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.cdiv, InterpretedFunction)


NOT_INTERPRETED = _import_interpreted() if INTERPRET and TRITON_INSTALLED else None


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    if INTERPRET and TRITON_INSTALLED:
        if NOT_INTERPRETED:
            pytest.fail(f"{NOT_INTERPRETED}: run these tests in a fresh process or import triton after this conftest")
        monkeypatch.setenv("TRITON_INTERPRET", "1")


SHARED_MEMORY_PER_BLOCK = {90: 227 * 1024, 80: 163 * 1024}
"""The most shared memory one block may take (opt-in), by CUDA architecture: Hopper, A100."""


@pytest.fixture
def compile_ahead_of_time(tmp_path):
    """`compile(arch, family)`: `python -m tests.engine.triton.ahead_of_time ARCH FAMILY` in a process without
    TRITON_INTERPRET and with an empty Triton cache (compiled now, not found); the configurations it compiled,
    each checked to have made a cubin within the architecture's shared memory."""

    def compile(arch: int, family: str) -> dict[str, dict]:
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(tmp_path)
        result = subprocess.run(
            [sys.executable, "-m", "tests.engine.triton.ahead_of_time", str(arch), family],
            cwd=Path(__file__).resolve().parents[3],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        compiled = {line["name"]: line for line in map(json.loads, result.stdout.splitlines())}
        limit = SHARED_MEMORY_PER_BLOCK[arch]
        assert all(c["cubin_bytes"] > 0 and c["shared_bytes"] <= limit for c in compiled.values()), compiled
        return compiled

    return compile
