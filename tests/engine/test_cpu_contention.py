"""The engine thread's team size from the CPU time other processes take on its CPUs: /proc/stat and /proc/self/stat
as text, a fake clock, and the team changes the governor makes."""

from pathlib import Path

import pytest

from engine.cpu_contention import CpuTicks, ThreadGovernor, others_cpus, parse_cpu_ticks, team_size

SELF_STAT = "4242 (python -m x) S 1 4242 4242 0 -1 4194560 100 0 0 0 {utime} {stime} 0 0 20 0 9 0 100 0 0\n"


def proc_stat(*cpus: tuple[int, int]) -> str:
    """/proc/stat with each CPU's (busy, idle) ticks (busy as user time; iowait 5 counted idle)."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    lines += [f"cpu{n} {busy} 0 0 {idle} 5 0 0 0 0 0" for n, (busy, idle) in enumerate(cpus)]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 99"]) + "\n"


def test_ticks_count_the_masks_cpus_and_this_process():
    ticks = parse_cpu_ticks(
        proc_stat((100, 50), (30, 120), (999, 0)), SELF_STAT.format(utime=70, stime=10), frozenset({0, 1})
    )
    assert ticks == CpuTicks(busy=130, total=310, own=80)


@pytest.mark.parametrize(
    "others, expected",
    [(0.0, 2), (0.3, 2), (0.5, 1), (1.0, 1), (2.0, 1)],  # a neighbour's fair half of a CPU already costs a thread
)
def test_the_team_gives_up_a_cpu_when_others_take_more_than_the_spare(others, expected):
    assert team_size(others, 2, 2) == expected


def test_a_budget_below_the_mask_caps_the_team():
    assert team_size(0.0, 8, 3) == 3
    assert team_size(6.0, 8, 3) == 2


def test_others_is_the_busy_time_that_was_not_this_process():
    before = CpuTicks(busy=0, total=0, own=0)
    after = CpuTicks(busy=150, total=200, own=100)  # 100 ticks per CPU passed; this process ran 100 of 150 busy
    assert others_cpus(before, after, 2) == pytest.approx(0.5)
    assert others_cpus(after, after, 2) is None


def test_the_governor_shrinks_the_team_under_a_neighbour_and_grows_it_back():
    # (busy, idle) ticks per CPU and this process's ticks, one reading per second
    readings = iter(
        [
            ((0, 0), (0, 0), 0),
            ((100, 0), (100, 0), 190),  # quiet: this process used both CPUs
            ((200, 0), (200, 0), 340),  # a neighbour took half of CPU 1 from the 2-thread team
            ((300, 0), (300, 0), 440),  # 1 thread now; the neighbour holds CPU 1
            ((400, 0), (400, 0), 630),  # the neighbour left
        ]
    )
    clock = [0.0]
    files: dict[str, str] = {}

    def read(path: Path) -> str:
        if path.name == "stat" and path.parent.name == "proc":
            cpu0, cpu1, own = next(readings)
            files["self"] = SELF_STAT.format(utime=own, stime=0)
            return proc_stat(cpu0, cpu1)
        return files["self"]

    teams: list[int] = []
    governor = ThreadGovernor(2, teams.append, frozenset({0, 1}), read=read, clock=lambda: clock[0])
    for _ in range(5):
        governor.after_step()
        governor.after_step()  # within the second: no reading
        clock[0] += 1.0
    assert teams == [1, 2]
    assert governor.threads == 2
