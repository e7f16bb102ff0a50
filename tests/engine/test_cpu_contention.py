"""The engine thread's team size from how long its threads waited for a CPU and how long its CPUs idled:
/proc/stat and the threads' schedstat as text, a fake clock, and the team changes the governor makes."""

from pathlib import Path

import pytest

from engine.cpu_contention import ThreadGovernor, next_team, parse_idle_ticks, parse_wait_ns


def proc_stat(*cpus: tuple[int, int]) -> str:
    """/proc/stat with each CPU's (busy, idle) ticks (busy as user time; 5 ticks of iowait counted idle)."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    lines += [f"cpu{n} {busy} 0 0 {idle} 5 0 0 0 0 0" for n, (busy, idle) in enumerate(cpus)]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 99"]) + "\n"


def test_idle_ticks_of_the_masks_cpus():
    assert parse_idle_ticks(proc_stat((100, 50), (30, 120), (999, 0)), frozenset({0, 1})) == (180, 310)


def test_wait_is_the_second_schedstat_field_summed():
    assert parse_wait_ns(["1000 250 3\n", "5 750 1\n", ""]) == 1000


@pytest.mark.parametrize(
    "threads, budget, waited, idle, expected",
    [
        (2, 2, 0.05, 0.1, 2),  # quiet: the server's own threads taking turns
        (2, 2, 0.5, 0.0, 1),  # a neighbour takes its fair half of one of the team's CPUs
        (1, 2, 0.1, 0.2, 1),  # one thread beside the neighbour: it waits little, no CPU idles
        (1, 2, 0.0, 1.0, 2),  # the neighbour left
        (4, 4, 2.0, 0.0, 2),  # two CPUs' worth of waiting: two threads fewer
        (1, 2, 0.0, 3.0, 2),  # the budget caps it
    ],
)
def test_the_team_shrinks_while_its_threads_wait_and_grows_while_cpus_idle(threads, budget, waited, idle, expected):
    assert next_team(threads, budget, waited, idle) == expected


def test_the_governor_follows_a_neighbour_coming_and_going():
    # per second: (CPU 0, CPU 1) (busy, idle) ticks, the threads' wait in ns
    seconds = iter(
        [
            (((0, 0), (0, 0)), 0),
            (((100, 0), (95, 5)), 5e7),  # quiet
            (((200, 0), (195, 5)), 6e8),  # a neighbour: the thread on its CPU waited 0.55 s
            (((300, 0), (295, 5)), 1.2e9),  # ... a second second: the team gives up a thread
            (((400, 0), (395, 5)), 1.3e9),  # 1 thread beside it
            (((495, 5), (400, 100)), 1.35e9),  # the neighbour left: CPU 1 idled
        ]
    )
    clock = [0.0]
    wait = ["0 0 0"]

    def read(path: Path) -> str:
        if path == Path("/proc/stat"):
            cpus, waited = next(seconds)
            wait[0] = f"123 {int(waited)} 9"
            return proc_stat(*cpus)
        return wait[0]

    teams: list[int] = []
    governor = ThreadGovernor(
        2, teams.append, frozenset({0, 1}), read=read, clock=lambda: clock[0], list_dir=lambda _: [Path("/t/1")]
    )
    for _ in range(6):
        governor.after_step()
        governor.after_step()  # within the second: nothing read
        clock[0] += 1.0
    assert teams == [1, 2]
    assert governor.threads == 2


def test_a_pause_without_steps_starts_afresh():
    reads = iter([proc_stat((0, 0), (0, 0)), proc_stat((100, 900), (100, 900))])  # 10 s, idle: no step ran
    clock = [0.0]
    teams: list[int] = []
    governor = ThreadGovernor(2, teams.append, frozenset({0, 1}), clock=lambda: clock[0], list_dir=lambda _: [])
    governor.threads = 1
    governor._read = lambda path: next(reads)  # noqa: SLF001 - the two readings of this test
    governor.after_step()
    clock[0] = 10.0
    governor.after_step()
    assert teams == [] and governor.threads == 1


def drive(governor_budget: int, per_second: list[tuple[float, int]]) -> list[tuple[int, int]]:
    """Run a governor over seconds of (threads' wait in s, CPU 1's idle ticks of 100); the (second, team) changes."""
    clock, state = [0.0], {"busy": 0, "idle": 0, "wait": 0.0}
    readings = iter(per_second)

    def read(path: Path) -> str:
        if path == Path("/proc/stat"):
            waited, idle = next(readings)
            state["busy"] += 200 - idle
            state["idle"] += idle
            state["wait"] += waited
            return proc_stat((state["busy"], 0), (0, state["idle"]))
        return f"1 {int(state['wait'] * 1e9)} 1"

    changes: list[tuple[int, int]] = []
    governor = ThreadGovernor(
        governor_budget,
        lambda team: changes.append((int(clock[0]), team)),
        frozenset({0, 1}),
        read=read,
        clock=lambda: clock[0],
        list_dir=lambda _: [Path("/t/1")],
    )
    for _ in per_second:
        governor.after_step()
        clock[0] += 1.0
    return changes


def test_a_lasting_neighbour_is_retried_less_and_less_often():
    # CPUs never idle (other processes fill them); the neighbour stays
    changes = drive(2, [(0.0, 0)] + [(0.6, 0)] * 40)
    # 2 s (two seconds of waiting): shrinks; 12 s: tries 2, whose threads wait: back to 1 at once (13 s); the next
    # try 20 s later
    assert changes == [(2, 1), (12, 2), (13, 1), (33, 2), (34, 1)]


def test_a_try_that_holds_keeps_the_team():
    seconds = [(0.0, 0)] + [(0.6, 0)] * 5 + [(0.05, 0)] * 20
    assert drive(2, seconds) == [(2, 1), (12, 2)]  # the neighbour left at 6 s: the try at 12 s holds


def test_one_second_of_waiting_is_not_a_neighbour():
    assert drive(2, [(0.0, 0), (0.9, 0)] + [(0.05, 0)] * 5) == []
