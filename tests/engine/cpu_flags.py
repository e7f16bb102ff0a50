"""What this CPU can run, for tests that build the native kernels for other targets (-march=haswell,
skylake-avx512) and must skip where the code would stop on an illegal instruction."""

from __future__ import annotations

import platform

import pytest

from engine.kernels.cpu import load_cpu_kernels


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of `flags` (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            text = cpuinfo.read()
    except OSError:
        return False
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return all(f" {flag} " in f"{line} " for flag in flags)


# builds for other targets than this machine's, with what a CPU must have to run them (what -march turns on that
# the kernels may use): AVX2, 6-row tiles in parts, the next block prefetched through a block's passes; AVX-512
# without BF16 (Skylake-SP, Cascade Lake), 6 x 64 in one pass
FLOAT32_TILE_ARCHES = {
    "haswell": ("avx2", "fma", "f16c", "bmi2", "movbe"),
    "skylake-avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "bmi2"),
}


def kernels_for(arch: str, cpu_kernels):
    """This CPU's kernels for "native", else the -march=`arch` build (the test skipped where this CPU cannot run
    its code: x86-64 runs anywhere on x86, haswell and skylake-avx512 need FLOAT32_TILE_ARCHES' flags)."""
    if arch == "native":
        return cpu_kernels
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_has(*FLOAT32_TILE_ARCHES.get(arch, ())):
        pytest.skip(f"this CPU cannot run -march={arch} code")
    kernels = load_cpu_kernels(arch=arch)
    assert kernels is not None, f"the -march={arch} build failed"
    return kernels
