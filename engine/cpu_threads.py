"""How many CPU threads the engine runs on: `--cpu-threads`, else OMP_NUM_THREADS, else the smaller of the CPUs in
the affinity mask and the cgroup's CPU quota (rounded down, at least 1), the way Go's runtime (GOMAXPROCS) and the
JVM size themselves inside a container. Torch alone takes one thread per CPU it sees and ignores the quota a
Kubernetes CPU limit sets, so a pod limited to 1 CPU on a 32-CPU node ran 32 threads that queue for one CPU's time.

    /proc/self/cgroup       "0::/kubepods/pod1/ctr"               (v2)   "4:cpu,cpuacct:/docker/abc"   (v1)
    /proc/self/mountinfo    ".. / /sys/fs/cgroup .. - cgroup2 .."        ".. /docker/abc /sys/fs/cgroup/cpu .. - cgroup .. rw,cpu,cpuacct"
    the cgroup's directory  mount point + (cgroup path - mount root): /sys/fs/cgroup/kubepods/pod1/ctr
    its quota               v2 cpu.max "150000 100000" (or "max ..."); v1 cpu.cfs_quota_us / cpu.cfs_period_us (-1: none)

A parent's quota limits its children too, so every directory from the cgroup's up to the mount point is read and
the smallest quota wins (Go 1.25 does the same). With both hierarchies mounted (hybrid), the v1 one that holds the
`cpu` controller is the one that enforces quotas. Nothing here imports torch: the CLI sizes OpenMP before torch
loads (server/cpu_runtime.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple, Optional

OMP_NUM_THREADS = "OMP_NUM_THREADS"


class CpuQuota(NamedTuple):
    """A cgroup's CPU quota: `quota_us` of CPU time per `period_us` of wall time (quota / period CPUs)."""

    quota_us: int
    period_us: int
    source: str  # the file that set it, e.g. "cgroup v2 cpu.max"

    @property
    def cpus(self) -> float:
        return self.quota_us / self.period_us

    def describe(self) -> str:
        return f"{self.source} {self.quota_us}/{self.period_us}"


@dataclass(frozen=True, slots=True)
class CpuThreads:
    """The engine's thread count and where it came from (logged at start-up)."""

    count: int
    source: str
    chosen: bool = False  # set by the user (flag, variable): kept as it is, never adapted

    def describe(self) -> str:
        return f"{self.count} thread{'s' if self.count != 1 else ''}: {self.source}"


class _Mount(NamedTuple):
    root: str  # the cgroup path the mount point shows
    point: Path


def choose_cpu_threads(
    requested: Optional[int], environ: Mapping[str, str], affinity_cpus: int, quota: Optional[CpuQuota]
) -> CpuThreads:
    """The thread count: the flag, else a valid OMP_NUM_THREADS (the user's explicit choice for OpenMP), else
    min(affinity mask, quota rounded down), at least 1."""
    if requested is not None:
        return CpuThreads(requested, "--cpu-threads / PAGEDSERVE_CPU_THREADS", chosen=True)
    omp = _positive_int(environ.get(OMP_NUM_THREADS, ""))
    if omp is not None:
        return CpuThreads(omp, f"{OMP_NUM_THREADS}={omp}", chosen=True)
    mask = max(affinity_cpus, 1)
    if quota is not None and int(quota.cpus) < mask:
        return CpuThreads(max(int(quota.cpus), 1), quota.describe())
    return CpuThreads(mask, "affinity mask")


def read_cpu_quota(proc_cgroup: str, mountinfo: str, root: Path = Path("/")) -> Optional[CpuQuota]:
    """The smallest CPU quota on the way from this process's cgroup up to its hierarchy's mount point; None when
    there is none (unlimited, no cgroup file system, unreadable files). `proc_cgroup` and `mountinfo`: the text of
    /proc/self/cgroup and /proc/self/mountinfo; `root`: where mount points are looked up (a fake tree in tests)."""
    v1_path, v2_path = _cgroup_paths(proc_cgroup)
    v1_mount, v2_mount = _cgroup_mounts(mountinfo)
    if v1_path is not None and v1_mount is not None:
        return _smallest_quota(_cgroup_dir(v1_mount, v1_path, root), _under(v1_mount.point, root), _read_v1)
    if v2_path is not None and v2_mount is not None:
        return _smallest_quota(_cgroup_dir(v2_mount, v2_path, root), _under(v2_mount.point, root), _read_v2)
    return None


def machine_cpu_threads(requested: Optional[int], environ: Mapping[str, str]) -> CpuThreads:
    """`choose_cpu_threads` over this process's affinity mask and cgroup files."""
    quota = None
    if requested is None:
        quota = read_cpu_quota(_read_text(Path("/proc/self/cgroup")), _read_text(Path("/proc/self/mountinfo")))
    return choose_cpu_threads(requested, environ, len(_affinity()), quota)


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no affinity masks on this OS)
        return set(range(os.cpu_count() or 1))


def _cgroup_paths(proc_cgroup: str) -> tuple[Optional[str], Optional[str]]:
    """(the v1 `cpu` controller's cgroup path, the v2 unified path) from /proc/self/cgroup's lines
    "hierarchy-id:controllers:path"."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v1, v2


def _cgroup_mounts(mountinfo: str) -> tuple[Optional[_Mount], Optional[_Mount]]:
    """(the v1 mount holding the `cpu` controller, the cgroup2 mount) from mountinfo's lines
    "id parent major:minor root mount-point options [optional...] - fstype source super-options"."""
    v1 = v2 = None
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mount = _Mount(_unescape(fields[3]), Path(_unescape(fields[4])))
        if tail[0] == "cgroup2" and v2 is None:
            v2 = mount
        elif tail[0] == "cgroup" and "cpu" in tail[2].split(",") and v1 is None:
            v1 = mount
    return v1, v2


def _cgroup_dir(mount: _Mount, path: str, root: Path) -> Path:
    """The cgroup's directory: its path relative to the mount's root, under the mount point. A path outside the
    mount's root (another cgroup namespace's view) gives the mount point itself."""
    relative = os.path.relpath(path, mount.root) if mount.root != "/" else path.lstrip("/")
    if relative == "." or relative.startswith(".."):
        relative = ""
    return _under(mount.point / relative, root)


def _under(path: Path, root: Path) -> Path:
    return root / path.relative_to(path.anchor) if path.is_absolute() else root / path


def _smallest_quota(directory: Path, top: Path, read) -> Optional[CpuQuota]:
    smallest: Optional[CpuQuota] = None
    while True:
        quota = read(directory)
        if quota is not None and (smallest is None or quota.cpus < smallest.cpus):
            smallest = quota
        if directory == top or top not in directory.parents:
            return smallest
        directory = directory.parent


def _read_v2(directory: Path) -> Optional[CpuQuota]:
    fields = _read_text(directory / "cpu.max").split()
    if len(fields) < 2 or fields[0] == "max":
        return None
    quota, period = _positive_int(fields[0]), _positive_int(fields[1])
    return None if quota is None or period is None else CpuQuota(quota, period, "cgroup v2 cpu.max")


def _read_v1(directory: Path) -> Optional[CpuQuota]:
    quota = _positive_int(_read_text(directory / "cpu.cfs_quota_us").strip())  # -1: no quota
    period = _positive_int(_read_text(directory / "cpu.cfs_period_us").strip())
    if quota is None or period is None:
        return None
    return CpuQuota(quota, period, "cgroup v1 cpu.cfs_quota_us/cpu.cfs_period_us")


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return ""


def _positive_int(text: str) -> Optional[int]:
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if value > 0 else None


def _unescape(field: str) -> str:
    r"""mountinfo writes space, tab, newline and backslash in paths as octal escapes (\040 ...)."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field
