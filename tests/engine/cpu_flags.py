"""What this CPU can run, for tests that build the native kernels for other targets (-march=haswell,
skylake-avx512) and must skip where the code would stop on an illegal instruction."""

from __future__ import annotations


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of `flags` (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            text = cpuinfo.read()
    except OSError:
        return False
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return all(f" {flag} " in f"{line} " for flag in flags)
