"""What machine the figures come from: CPU model, the vector/matrix extensions that decide the speed of each
server here (AVX2, AVX-512, AVX-512 BF16, AMX), cores, memory."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def _cpuinfo() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor is enough
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def isa_label(flags: set[str]) -> str:
    """The widest matrix path: amx, avx512-bf16, avx512, avx2 or baseline."""
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "baseline"


def cpu_info() -> dict:
    fields = _cpuinfo()
    flags = set(fields.get("flags", "").split())
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    try:
        memory_kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        memory_kib = 0
    return {
        "model": fields.get("model name") or platform.processor() or platform.machine(),
        "isa": isa_label(flags),
        "flags": [f for f in FLAGS if f in flags],
        "cores": usable,
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(memory_kib / 2**20, 1),
        "machine": platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def cpu_line() -> str:
    """The line a benchmark starts with: CPU model, usable cores, the FLAGS it has, and the load average now."""
    info = cpu_info()
    return f"cpu: {info['model']} ({info['cores']} cores; {' '.join(info['flags'])}); load {os.getloadavg()[0]:.2f}"


def short_name(info: dict) -> str:
    """e.g. 'amd-epyc-avx512-bf16', 'xeon-platinum-8480-amx': for the results folder's name."""
    model = re.sub(r"\((r|tm)\)|\bcpu\b|\bprocessor\b|@.*$|\d+-core|\bintel\b", " ", info["model"], flags=re.I)
    words = re.findall(r"[a-z0-9]+", model.lower())[:4] or ["cpu"]
    return "-".join(words + [info["isa"]])
