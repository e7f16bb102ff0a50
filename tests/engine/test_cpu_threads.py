"""The engine's thread count from the flag, OMP_NUM_THREADS, the affinity mask and the cgroup CPU quota, the quota
read from fake cgroup trees (v1, v2, hybrid, nested, unlimited, missing files) laid out under a temporary root."""

import os
from pathlib import Path

import pytest

from engine.cpu_threads import CpuQuota, CpuThreads, choose_cpu_threads, machine_cpu_threads, read_cpu_quota

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_CPU_MOUNT = "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
V1_OTHER_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
    "33 31 0:30 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
    "34 31 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
)


def write(root: Path, path: str, text: str) -> None:
    file = root / path.lstrip("/")
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)


def test_v2_takes_the_smallest_quota_from_the_cgroup_up_to_the_mount_point(tmp_path):
    write(tmp_path, "/sys/fs/cgroup/cpu.max", "max 100000\n")
    write(tmp_path, "/sys/fs/cgroup/kubepods/cpu.max", "400000 100000\n")
    write(tmp_path, "/sys/fs/cgroup/kubepods/pod1/cpu.max", "150000 100000\n")  # the pod's limit: 1.5 CPUs
    write(tmp_path, "/sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n")
    quota = read_cpu_quota("0::/kubepods/pod1/ctr\n", V2_MOUNT, tmp_path)
    assert quota == CpuQuota(150000, 100000, "cgroup v2 cpu.max")
    threads = choose_cpu_threads(None, {}, 8, quota)
    assert threads == CpuThreads(1, "cgroup v2 cpu.max 150000/100000")
    assert threads.describe() == "1 thread: cgroup v2 cpu.max 150000/100000"


def test_v2_in_a_cgroup_namespace_reads_the_mount_point_itself(tmp_path):
    write(tmp_path, "/sys/fs/cgroup/cpu.max", "200000 100000\n")
    quota = read_cpu_quota("0::/\n", V2_MOUNT, tmp_path)
    assert choose_cpu_threads(None, {}, 4, quota).describe() == "2 threads: cgroup v2 cpu.max 200000/100000"


def test_v2_max_or_missing_files_mean_no_quota(tmp_path):
    write(tmp_path, "/sys/fs/cgroup/app/cpu.max", "max 100000\n")
    assert read_cpu_quota("0::/app\n", V2_MOUNT, tmp_path) is None
    assert read_cpu_quota("0::/elsewhere\n", V2_MOUNT, tmp_path) is None  # no cpu.max on the way up
    assert read_cpu_quota("0::/app\n", "", tmp_path) is None  # no cgroup file system mounted
    assert read_cpu_quota("", V2_MOUNT, tmp_path) is None  # no /proc/self/cgroup (not Linux)
    write(tmp_path, "/sys/fs/cgroup/app/cpu.max", "garbage\n")
    assert read_cpu_quota("0::/app\n", V2_MOUNT, tmp_path) is None


def test_v1_hybrid_reads_the_cpu_controllers_hierarchy_relative_to_its_mount_root(tmp_path):
    # a container whose v1 cpu hierarchy is mounted at its own cgroup (root /docker/abc), beside a cgroup2 mount
    mountinfo = V1_OTHER_MOUNTS + V1_CPU_MOUNT.format(root="/docker/abc") + V2_MOUNT
    proc_cgroup = "5:cpu,cpuacct:/docker/abc/worker\n4:memory:/docker/abc\n0::/\n"
    write(tmp_path, "/sys/fs/cgroup/cpu,cpuacct/worker/cpu.cfs_quota_us", "-1\n")
    write(tmp_path, "/sys/fs/cgroup/cpu,cpuacct/worker/cpu.cfs_period_us", "100000\n")
    write(tmp_path, "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "250000\n")
    write(tmp_path, "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    write(tmp_path, "/sys/fs/cgroup/cpu.max", "100000 100000\n")  # v2's, not the one enforcing here
    quota = read_cpu_quota(proc_cgroup, mountinfo, tmp_path)
    assert quota == CpuQuota(250000, 100000, "cgroup v1 cpu.cfs_quota_us/cpu.cfs_period_us")
    assert choose_cpu_threads(None, {}, 4, quota).count == 2  # 2.5 CPUs, rounded down


def test_v1_without_a_quota_and_a_path_outside_the_mount_root(tmp_path):
    mountinfo = V1_CPU_MOUNT.format(root="/")
    write(tmp_path, "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(tmp_path, "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert read_cpu_quota("2:cpuacct,cpu:/\n", mountinfo, tmp_path) is None
    # the cgroup path seen from another namespace than the mount's: the mount point's own files
    write(tmp_path, "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "50000\n")
    quota = read_cpu_quota("2:cpu:/../outside\n", V1_CPU_MOUNT.format(root="/inner"), tmp_path)
    assert quota is not None and quota.cpus == 0.5
    assert choose_cpu_threads(None, {}, 2, quota).count == 1  # half a CPU: still one thread


def test_escaped_mount_points_are_found(tmp_path):
    mountinfo = "30 23 0:26 / /cgroup\\040root rw - cgroup2 cgroup2 rw\n"
    write(tmp_path, "/cgroup root/cpu.max", "300000 100000\n")
    assert read_cpu_quota("0::/\n", mountinfo, tmp_path) == CpuQuota(300000, 100000, "cgroup v2 cpu.max")


@pytest.mark.parametrize(
    "requested, environ, affinity, quota, expected",
    [
        (None, {}, 4, None, CpuThreads(4, "affinity mask")),
        (None, {}, 2, CpuQuota(400000, 100000, "q"), CpuThreads(2, "affinity mask")),  # quota above the mask
        (
            None,
            {"OMP_NUM_THREADS": "3"},
            8,
            CpuQuota(100000, 100000, "q"),
            CpuThreads(3, "OMP_NUM_THREADS=3", chosen=True),
        ),
        (None, {"OMP_NUM_THREADS": "two"}, 2, None, CpuThreads(2, "affinity mask")),  # invalid: ignored
        (5, {"OMP_NUM_THREADS": "3"}, 2, None, CpuThreads(5, "--cpu-threads / PAGEDSERVE_CPU_THREADS", chosen=True)),
        (None, {}, 0, None, CpuThreads(1, "affinity mask")),
    ],
)
def test_the_flag_then_omp_num_threads_then_the_smaller_of_mask_and_quota(
    requested, environ, affinity, quota, expected
):
    assert choose_cpu_threads(requested, environ, affinity, quota) == expected


def test_this_machines_threads_fit_its_affinity_mask():
    threads = machine_cpu_threads(None, {})
    assert 1 <= threads.count <= len(os.sched_getaffinity(0))
    assert threads.source == "affinity mask" or threads.source.startswith("cgroup v")
