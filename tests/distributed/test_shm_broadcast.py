"""The step broadcast: one writer, readers in spawned processes (or in this one, where a test needs to steer
them step by step); every reader gets every message in order, large ones included; timeouts name who is late;
close ends the readers; nothing is left in /dev/shm nor reported leaked by the resource tracker."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from benchmarks.shm_broadcast import make_step
from engine.distributed.shm_broadcast import SEGMENT_PREFIX, BroadcastClosed, ShmBroadcastQueue
from tests.distributed.readers import collect
from tests.distributed.conftest import our_segments

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)  # a broken queue hangs rather than fails: bound every test


@contextmanager
def spawned_readers(queue: ShmBroadcastQueue, timeout: float = 10.0):
    """The queue's readers as spawned processes running `collect`; yields a function that returns
    {index: (messages, ending)} once all have reported."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [
        context.Process(target=collect, args=(queue.handle, k, results, timeout), daemon=True)
        for k in range(queue.handle.num_readers)
    ]
    for proc in procs:
        proc.start()

    def gather() -> dict[int, tuple[list[object], str]]:
        reports = [results.get(timeout=30) for _ in procs]
        return {index: (messages, ending) for index, messages, ending in reports}

    try:
        yield gather
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


@pytest.mark.parametrize("num_readers", [2, 3])
def test_every_reader_gets_every_message_in_order_round_the_ring(num_readers):
    messages = [(i, "x" * (i * 7 % 300)) for i in range(60)]  # 60 messages through 4 slots: 15 turns
    with ShmBroadcastQueue.create(num_readers, slot_bytes=512, num_slots=4, enqueue_timeout_s=20) as queue:
        with spawned_readers(queue) as gather:
            for message in messages:
                queue.enqueue(message)
            queue.close()  # readers blocked in dequeue wake up, read what is left, then see the close
            reports = gather()
    assert reports == {k: (messages, "closed") for k in range(num_readers)}


def test_a_64_request_scheduler_output_round_trips_equal():
    steps = [make_step(64, num_new=4, seed=seed) for seed in range(3)]
    with ShmBroadcastQueue.create(3, slot_bytes=16 << 10, num_slots=2) as queue:  # the 3rd step wraps
        with spawned_readers(queue) as gather:
            for step in steps:
                queue.enqueue(step)
            queue.close()
            reports = gather()
    assert all(received == steps and ending == "closed" for received, ending in reports.values())


def test_a_message_larger_than_a_slot_reaches_spawned_readers():
    big = bytes(range(256)) * 1000  # 256 kB through 1 kB slots
    messages = ["before", big, "between", {"big": big, "n": 3}, "after"]
    with ShmBroadcastQueue.create(2, slot_bytes=1024, num_slots=2) as queue:
        with spawned_readers(queue) as gather:
            for message in messages:
                queue.enqueue(message)
            queue.close()
            reports = gather()
    assert reports == {0: (messages, "closed"), 1: (messages, "closed")}


def test_an_overflow_segment_is_unlinked_once_every_reader_has_read_it():
    with ShmBroadcastQueue.create(2, slot_bytes=256, num_slots=4) as queue:
        readers = [queue.handle.open(k) for k in range(2)]
        ring = our_segments(SEGMENT_PREFIX)
        queue.enqueue(b"y" * 10_000)
        assert len(our_segments(SEGMENT_PREFIX) - ring) == 1
        assert readers[0].dequeue(timeout=1) == b"y" * 10_000
        queue.enqueue("small")
        assert len(our_segments(SEGMENT_PREFIX) - ring) == 1  # reader 1 has not read it yet
        assert readers[1].dequeue(timeout=1) == b"y" * 10_000
        queue.enqueue("small")
        assert our_segments(SEGMENT_PREFIX) == ring  # long before its slot comes round again
        for reader in readers:
            reader.close()


def test_close_unlinks_an_overflow_segment_nobody_read_and_the_reader_sees_the_close():
    queue = ShmBroadcastQueue.create(1, slot_bytes=256, num_slots=2)
    reader = queue.handle.open(0)
    queue.enqueue(b"z" * 10_000)
    queue.close(timeout=0)
    with pytest.raises(BroadcastClosed):
        reader.dequeue(timeout=1)
    reader.close()


def test_dequeue_times_out_when_nothing_comes():
    with ShmBroadcastQueue.create(2, slot_bytes=256, num_slots=2) as queue:
        reader = queue.handle.open(1)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="reader 1 got no message 1 within 0.1 s"):
            reader.dequeue(timeout=0.1)
        assert time.monotonic() - start < 1
        queue.enqueue("late")  # the timeout lost nothing
        assert reader.dequeue(timeout=1) == "late"
        reader.close()


def test_the_writer_names_the_readers_that_lag_and_loses_nothing():
    with ShmBroadcastQueue.create(3, slot_bytes=256, num_slots=2) as queue:
        readers = [queue.handle.open(k) for k in range(3)]
        for n in (1, 2):
            queue.enqueue(n)
        for k in (0, 2):
            assert [readers[k].dequeue(timeout=1) for _ in range(2)] == [1, 2]
        with pytest.raises(TimeoutError, match=r"reader\(s\) \[1\] of 3 have not read message 1 after 0.2 s"):
            queue.enqueue(3, timeout=0.2)
        assert readers[1].dequeue(timeout=1) == 1
        queue.enqueue(3)
        assert [readers[1].dequeue(timeout=1) for _ in range(2)] == [2, 3]
        assert [readers[k].dequeue(timeout=1) for k in (0, 2)] == [3, 3]
        for reader in readers:
            reader.close()


def test_close_wakes_a_waiting_reader_and_every_later_call_says_closed():
    queue = ShmBroadcastQueue.create(1, slot_bytes=256, num_slots=2)
    reader = queue.handle.open(0)
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            reader.dequeue(timeout=10)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.1)
    start = time.monotonic()
    queue.close()
    thread.join(5)
    assert time.monotonic() - start < 1 and isinstance(outcome[0], BroadcastClosed)
    with pytest.raises(BroadcastClosed):
        reader.dequeue(timeout=0)
    with pytest.raises(BroadcastClosed):
        queue.enqueue("after")
    queue.close()  # idempotent
    reader.close()


def test_an_unpicklable_message_changes_nothing():
    with ShmBroadcastQueue.create(1, slot_bytes=256, num_slots=2) as queue:
        reader = queue.handle.open(0)
        with pytest.raises((AttributeError, TypeError, Exception)):
            queue.enqueue(lambda: None)
        queue.enqueue("next")
        assert reader.dequeue(timeout=1) == "next"
        reader.close()


def test_bad_sizes_are_refused_before_anything_is_created():
    with pytest.raises(ValueError):
        ShmBroadcastQueue.create(0)
    with pytest.raises(ValueError):
        ShmBroadcastQueue.create(1, slot_bytes=8)


LEAK_CHECK = """
import multiprocessing
from engine.distributed.shm_broadcast import ShmBroadcastQueue
from tests.distributed.readers import collect

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    queue = ShmBroadcastQueue.create(2, slot_bytes=512, num_slots=2)
    procs = [context.Process(target=collect, args=(queue.handle, k, results, 10)) for k in range(2)]
    for proc in procs:
        proc.start()
    for message in ["a", b"b" * 5000, "c"]:
        queue.enqueue(message)
    unread = ShmBroadcastQueue.create(1, slot_bytes=256, num_slots=2)
    unread.enqueue(b"never read" * 100)  # its overflow segment too goes at close
    unread.close(timeout=0)
    queue.close()
    reports = sorted(results.get(timeout=20) for _ in procs)
    for proc in procs:
        proc.join(10)
    assert [ending for _, _, ending in reports] == ["closed", "closed"], reports
    print("ok")
"""


def test_no_leak_reported_by_the_resource_tracker(tmp_path):
    """The tracker reports leaks when its last user exits: so in a process of its own, with spawned readers."""
    script = tmp_path / "leak_check.py"
    script.write_text(LEAK_CHECK)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert "leaked" not in done.stderr and "Traceback" not in done.stderr, done.stderr
