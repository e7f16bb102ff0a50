"""The shared-memory all-reduce between real (spawned) processes: sums within rounding of a float64 reference
and no worse than gloo's, bit-identical on every rank, through buffers smaller than the tensor; all-gathers
exact through shared memory and gloo; a dead peer fails the others in well under a second, a stuck one after the
timeout; nothing left in /dev/shm."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.distributed.cpu_binding import RankCpus, plan_rank_cpus
from engine.distributed.shm_all_reduce import SEGMENT_PREFIX, PeerGoneError, ShmAllReduce  # noqa: F401 (conftest)
from tests.distributed.reducers import DTYPES, SIZES, partial, reduce_all, reduce_until
from tests.ports import free_port

pytestmark = pytest.mark.timeout(120)  # a broken barrier hangs rather than fails: bound every test


def run_ranks(target, world: int, args_of, reports: int | None = None, timeout: float = 60) -> list[tuple]:
    """`target` in `world` spawned processes (args_of(rank, results) -> args); the first `reports` reports
    (default: one from each)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=target, args=args_of(rank, results), daemon=True) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        return [results.get(timeout=timeout) for _ in range(world if reports is None else reports)]
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


@pytest.mark.parametrize("world", [2, 3])
def test_sums_match_float64_and_gloo_and_every_rank_holds_the_same_bits(world):
    # 64 KiB slots: [257, 2048] goes through in 17 (bf16) or 33 (float32) chunks.
    with ShmAllReduce.create(world, slot_bytes=64 << 10, timeout_s=30) as owner:
        port = free_port()
        reports = run_ranks(reduce_all, world, lambda rank, q: (rank, world, port, owner.handle, q))
    by_rank = {rank: {key: torch.from_numpy(value) for key, value in report.items()} for rank, report in reports}
    assert sorted(by_rank) == list(range(world))
    for shape in SIZES:
        for dtype in DTYPES:
            key = (shape, str(dtype))
            reference = sum(partial(rank, shape, dtype).double() for rank in range(world))
            shm, gloo = by_rank[0][(*key, "shm")].double(), by_rank[0][(*key, "gloo")].double()
            for rank in range(1, world):
                assert torch.equal(by_rank[rank][(*key, "shm")], by_rank[0][(*key, "shm")]), (key, rank)
                assert torch.equal(by_rank[rank][(*key, "strided")], by_rank[0][(*key, "strided")]), (key, rank)
            error = (shm - reference).abs()
            if dtype == torch.bfloat16:  # summed in float32, rounded once: within half a bf16 ulp, not above gloo's
                assert bool((error <= reference.abs() * 2**-8 * 1.001 + 1e-30).all()), key
                assert error.max() <= (gloo - reference).abs().max(), key
            else:  # float32 additions in another order than gloo's: both within rounding of the reference
                torch.testing.assert_close(shm, reference, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(shm, gloo, rtol=1e-6, atol=1e-6)
            strided = sum(partial(rank, shape[::-1], dtype).double() for rank in range(world)).t()
            torch.testing.assert_close(by_rank[0][(*key, "strided")].double(), strided, rtol=1e-2, atol=1e-5)
            stacked = torch.stack([partial(rank, shape, dtype) for rank in range(world)]).float()
            for rank in range(world):  # a gather moves bits: exact, on every rank, through either path
                assert torch.equal(by_rank[rank][(*key, "shm gather")], stacked), (key, rank)
                assert torch.equal(by_rank[rank][(*key, "gloo gather")], stacked), (key, rank)


@pytest.mark.parametrize("world, dead", [(2, 1), (3, 2), (3, 0)])
def test_a_peer_that_dies_makes_the_others_raise_fast(world, dead):
    with ShmAllReduce.create(world, slot_bytes=64 << 10, timeout_s=60) as owner:
        # Rank `dead` exits before its 6th call; the others report how theirs ended.
        reports = run_ranks(
            reduce_until, world, lambda rank, q: (rank, owner.handle, q, 5 if rank == dead else None), world - 1
        )
    for rank, kind, message, waited, call in reports:
        assert kind == "PeerGoneError", (rank, kind, message)
        assert f"rank {dead}" in message or "aborted" in message
        assert waited < 2.0 and call == 5


def test_a_stuck_peer_times_out_naming_it_and_the_group_stays_failed():
    with ShmAllReduce.create(3, slot_bytes=4096, timeout_s=0.3) as owner:
        comm = owner.handle.open(0)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[1, 2\] of 3 did not arrive within 0.3 s"):
            comm.all_reduce(torch.ones(8))
        assert time.monotonic() - start < 2
        with pytest.raises(PeerGoneError, match="unusable"):
            comm.all_reduce(torch.ones(8))
        comm.close()


def test_the_owners_abort_wakes_a_waiting_rank_at_once():
    """What rank 0's watcher does when a worker dies: the all-reduce waiting for it raises now."""
    with ShmAllReduce.create(2, slot_bytes=4096, timeout_s=30) as owner:
        comm = owner.handle.open(0)
        outcome: list[BaseException] = []

        def wait() -> None:
            try:
                comm.all_reduce(torch.ones(8))
            except BaseException as error:
                outcome.append(error)

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.2)
        start = time.monotonic()
        owner.abort()
        thread.join(5)
        assert time.monotonic() - start < 0.5
        assert isinstance(outcome[0], PeerGoneError) and "aborted" in str(outcome[0])
        comm.close()


def test_float16_is_summed_in_float32_and_rounded_once():
    """2048 + 1 + 1: float16 additions in turn give 2048 (2049 is a tie, rounded to even); one rounding gives 2050.
    Three ranks on threads of this process, 64-byte slots (32 halves a chunk)."""
    with ShmAllReduce.create(3, slot_bytes=64, timeout_s=5) as owner:
        comms = [owner.handle.open(rank) for rank in range(3)]
        inputs = [torch.full((100,), 2048.0, dtype=torch.float16)] + [torch.ones(100, dtype=torch.float16)] * 2
        inputs = [tensor.clone() for tensor in inputs]
        threads = [threading.Thread(target=comms[r].all_reduce, args=(inputs[r],)) for r in (1, 2)]
        for thread in threads:
            thread.start()
        comms[0].all_reduce(inputs[0])
        for thread in threads:
            thread.join(5)
        assert all(torch.equal(tensor, torch.full((100,), 2050.0, dtype=torch.float16)) for tensor in inputs)
        for comm in comms:
            comm.close()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        ShmAllReduce.create(1)
    with pytest.raises(ValueError):
        ShmAllReduce.create(2, slot_bytes=8)


@pytest.mark.parametrize(
    "mask, world, threads, expected",
    [
        (set(range(8)), 2, None, [((0, 1, 2, 3), 4), ((4, 5, 6, 7), 4)]),
        (set(range(7)), 2, None, [((0, 1, 2, 3), 4), ((4, 5, 6), 3)]),
        (set(range(8)), 2, 2, [((0, 1, 2, 3), 1), ((4, 5, 6, 7), 1)]),
        ({2, 3}, 2, None, [((2,), 1), ((3,), 1)]),
        ({0}, 2, None, [(None, 1), (None, 1)]),
    ],
)
def test_each_rank_gets_a_contiguous_chunk_of_the_mask_and_its_share_of_the_threads(mask, world, threads, expected):
    plan = plan_rank_cpus(mask, world, threads)
    assert [(share.cpus, share.threads) for share in plan] == expected
    if expected[0][0] is None:
        assert "1 CPU(s) in the affinity mask for 2 ranks" in plan[0].describe(0)
    assert isinstance(plan[0], RankCpus)


def test_an_engine_with_two_ranks_reduces_through_shared_memory_and_gives_its_cpus_back(tiny_model_dir, caplog):
    from engine import LLM, SamplingParams

    before = os.sched_getaffinity(0)
    caplog.set_level(logging.INFO)
    with LLM(str(tiny_model_dir), dtype="float32", device="cpu", tensor_parallel_size=2) as llm:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        assert (
            len(llm.generate([{"prompt_token_ids": [5, 9, 27]}], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        )
    messages = "\n".join(record.getMessage() for record in caplog.records)
    assert "all-reduce over shared memory" in messages
    assert re.search(r"tp rank 0: (CPUs [\d,-]+|not pinned), \d+ thread\(s\)", messages), messages
    assert os.sched_getaffinity(0) == before


LEAK_CHECK = """
import multiprocessing
from engine.distributed.shm_all_reduce import ShmAllReduce
from tests.distributed.reducers import reduce_until

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    owner = ShmAllReduce.create(2, slot_bytes=4096)
    procs = [context.Process(target=reduce_until, args=(k, owner.handle, results, None, 20)) for k in range(2)]
    for proc in procs:
        proc.start()
    reports = sorted(results.get(timeout=20) for _ in procs)
    for proc in procs:
        proc.join(10)
    owner.close()
    assert [kind for _, kind, *_ in reports] == ["done", "done"], reports
    print("ok")
"""


def test_no_leak_reported_by_the_resource_tracker(tmp_path):
    """The tracker reports leaks (segments, semaphores) when its last user exits: so in a process of its own."""
    script = tmp_path / "leak_check.py"
    script.write_text(LEAK_CHECK)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert "leaked" not in done.stderr and "Traceback" not in done.stderr, done.stderr
