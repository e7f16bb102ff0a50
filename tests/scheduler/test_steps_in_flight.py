"""Several steps in flight (max_concurrent_batches > 1, pipeline parallelism): who is scheduled, who waits,
which blocks become hits when, and what an abort in flight leaves behind."""

import random

import pytest

from tests.scheduler.factories import check_invariants, make_request, make_scheduler, sample_for
from tests.scheduler.pipeline_driver import PipelineDriver
from tests.scheduler.recording_runner import RecordingRunner


def update(s, output):
    """The step's update with what a runner samples: a token for each request at its sequence's end (ended ones
    included: the runner learns of an abort only in a later step)."""
    sampled = {
        request_id: [7]
        for request_id, num_tokens in output.num_scheduled_tokens.items()
        if request_id not in s.requests
        or output.num_computed_tokens[request_id] + num_tokens == s.requests[request_id].num_tokens
    }
    outputs = s.update_from_output(output, sampled)
    check_invariants(s)
    return outputs


def num_hit_tokens(s, prompt):
    return s.kv_cache_manager.get_computed_blocks(make_request(prompt))[1]


def test_consecutive_steps_schedule_disjoint_requests_up_to_the_limit():
    s = make_scheduler(max_num_batched_tokens=16, max_concurrent_batches=2)
    for i in range(4):
        s.add_request(make_request(8, first_token=100 + 10 * i, request_id=f"r{i}"))
    first = s.schedule()
    second = s.schedule()
    assert set(first.num_scheduled_tokens) == {"r0", "r1"} and set(second.num_scheduled_tokens) == {"r2", "r3"}
    assert s.num_outstanding_steps == 2
    check_invariants(s)
    with pytest.raises(RuntimeError, match="at most 2 may be in flight"):
        s.schedule()
    update(s, first)
    third = s.schedule()  # r0 and r1 decode while r2 and r3's prompts are in flight
    assert set(third.num_scheduled_tokens) == {"r0", "r1"}
    assert third.num_computed_tokens == {"r0": 8, "r1": 8}


def test_a_decode_waits_for_the_update_of_the_step_before_it():
    s = make_scheduler(max_concurrent_batches=3)
    s.add_request(make_request(8, request_id="a", max_tokens=3))
    prompt = s.schedule()
    waiting = s.schedule()
    assert waiting.is_empty and s.num_outstanding_steps == 1  # an empty step is not in flight
    assert update(s, waiting) == []  # and needs no update
    (out,) = update(s, prompt)
    assert out.new_token_ids == [7]
    decode = s.schedule()
    assert decode.num_scheduled_tokens == {"a": 1} and decode.num_computed_tokens == {"a": 8}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_in_flight_is_never_preempted_the_one_that_needs_blocks_waits(policy):
    """a decodes into a new block while b, the policy's victim, is in flight: a waits (no one is preempted)
    and the step is empty; once b's step is updated, a preempts b as with one step in flight."""
    s = make_scheduler(
        num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, policy=policy, max_concurrent_batches=2
    )
    a = make_request(8, request_id="a", max_tokens=4, priority=0, ignore_eos=True)
    b = make_request(8, first_token=200, request_id="b", max_tokens=4, priority=1, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    step_a = s.schedule()  # a's whole prompt takes the budget
    step_b = s.schedule()  # b's prompt: the pool is full
    assert set(step_a.num_scheduled_tokens) == {"a"} and set(step_b.num_scheduled_tokens) == {"b"}
    assert s.kv_cache_manager.block_pool.num_free_blocks == 0
    update(s, step_a)
    blocks_of_b = s.kv_cache_manager.get_block_ids("b")
    stalled = s.schedule()  # a's decode needs a third block; its victim would be b, in flight
    assert stalled.is_empty and not stalled.preempted_request_ids and s.num_preemptions == 0
    assert s.kv_cache_manager.get_block_ids("b") == blocks_of_b
    update(s, step_b)
    resumed = s.schedule()  # nothing in flight: as with max_concurrent_batches 1
    assert resumed.preempted_request_ids == {"b"} and set(resumed.num_scheduled_tokens) == {"a"}
    driver = PipelineDriver(s, lambda output: sample_for(s, output))
    driver.in_flight.append((resumed, sample_for(s, resumed)))
    driver.drive()
    assert a.num_output_tokens == b.num_output_tokens == 4 and s.kv_cache_manager.usage == 0


def test_a_victim_outside_the_steps_in_flight_is_preempted_by_the_policy():
    """Priority: c, the lowest priority outside the steps in flight, goes; b, lower still but in flight, stays."""
    s = make_scheduler(
        num_blocks=5,
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        policy="priority",
        max_concurrent_batches=2,
    )
    a = make_request(8, request_id="a", max_tokens=4, priority=0, ignore_eos=True)
    c = make_request(8, first_token=300, request_id="c", max_tokens=4, priority=1, ignore_eos=True)
    b = make_request(4, first_token=200, request_id="b", max_tokens=4, priority=2, ignore_eos=True)
    for request in (a, b, c):
        s.add_request(request)
    prompts = s.schedule()  # two of the three (an even share of the two steps in flight), by priority
    step_b = s.schedule()
    assert set(prompts.num_scheduled_tokens) == {"a", "c"} and set(step_b.num_scheduled_tokens) == {"b"}
    assert s.kv_cache_manager.block_pool.num_free_blocks == 0
    update(s, prompts)
    decode = s.schedule()  # a needs a block: c goes, not b (in flight)
    assert decode.preempted_request_ids == {"c"} and set(decode.num_scheduled_tokens) == {"a"}
    assert b.status.name == "RUNNING" and s.kv_cache_manager.get_block_ids("b") == step_b.new_requests[0].block_ids
    update(s, step_b)
    update(s, decode)


def test_each_update_commits_its_own_steps_blocks_oldest_first():
    s = make_scheduler(max_num_batched_tokens=9, max_concurrent_batches=2)
    prompt_a, prompt_b = list(range(100, 109)), list(range(200, 209))
    s.add_request(make_request(prompt_a, request_id="a"))
    s.add_request(make_request(prompt_b, request_id="b"))
    step_a = s.schedule()
    step_b = s.schedule()
    assert set(step_a.num_scheduled_tokens) == {"a"} and set(step_b.num_scheduled_tokens) == {"b"}
    assert s.kv_cache_manager.num_pending_blocks == 4
    with pytest.raises(ValueError, match="not the oldest in flight"):
        s.update_from_output(step_b, {})
    assert num_hit_tokens(s, prompt_a) == num_hit_tokens(s, prompt_b) == 0
    update(s, step_a)
    assert num_hit_tokens(s, prompt_a) == 8 and num_hit_tokens(s, prompt_b) == 0
    assert s.kv_cache_manager.num_pending_blocks == 2
    update(s, step_b)
    assert num_hit_tokens(s, prompt_b) == 8 and s.kv_cache_manager.num_pending_blocks == 0
    with pytest.raises(ValueError, match="not the oldest in flight"):
        s.update_from_output(step_b, {})  # twice


def test_a_request_aborted_in_flight_frees_its_blocks_at_once_and_none_becomes_a_hit():
    s = make_scheduler(num_blocks=16, max_num_batched_tokens=12, max_concurrent_batches=2)
    prompt_a = list(range(100, 109))
    s.add_request(make_request(prompt_a, request_id="a"))
    step_a = s.schedule()
    s.add_request(make_request(9, first_token=200, request_id="b"))
    step_b = s.schedule()
    assert s.kv_cache_manager.num_pending_blocks == 4
    s.abort(["a"])
    check_invariants(s)
    assert s.kv_cache_manager.block_pool.num_free_blocks == 16 - 3 and s.kv_cache_manager.num_pending_blocks == 2
    s.add_request(make_request(prompt_a, request_id="a"))  # the id again, while the aborted one is in flight
    assert update(s, step_a) == []  # the late update of the aborted request is ignored
    assert num_hit_tokens(s, prompt_a) == 0
    notice = s.schedule()  # b in flight, and the new "a" only now admitted (its id left the steps in flight)
    assert notice.finished_request_ids == {"a"} and [n.request_id for n in notice.new_requests] == ["a"]
    assert notice.num_computed_tokens == {"a": 0}
    update(s, step_b)
    driver = PipelineDriver(s, lambda output: sample_for(s, output))
    driver.in_flight.append((notice, sample_for(s, notice)))
    driver.drive()
    assert s.kv_cache_manager.usage == 0 and s.num_outstanding_steps == 0


def test_an_empty_step_still_delivers_finished_notices_and_is_not_in_flight():
    s = make_scheduler(max_concurrent_batches=2)
    s.add_request(make_request(8, request_id="a"))
    s.add_request(make_request(8, first_token=200, request_id="b"))
    step = s.schedule()
    s.abort(["b"])
    empty = s.schedule()
    assert empty.is_empty and empty.finished_request_ids == {"b"} and s.num_outstanding_steps == 1
    update(s, step)


def test_abandoned_steps_index_nothing_and_their_requests_are_scheduled_again():
    s = make_scheduler(max_num_batched_tokens=9, max_concurrent_batches=2)
    s.add_request(make_request(9, request_id="a"))
    s.add_request(make_request(9, first_token=200, request_id="b"))
    first, second = s.schedule(), s.schedule()
    s.abandon_steps()
    check_invariants(s)
    assert s.num_outstanding_steps == 0 and s.kv_cache_manager.num_pending_blocks == 0
    for stale in (first, second):
        with pytest.raises(ValueError):
            s.update_from_output(stale, {})
    assert set(first.num_scheduled_tokens) == {"a"} and set(second.num_scheduled_tokens) == {"b"}
    again = s.schedule()
    assert again.num_computed_tokens == {"a": 0} and again.num_scheduled_tokens == {"a": 9}


def test_the_running_requests_take_turns_in_even_shares_of_the_steps_in_flight():
    """Eight requests and three steps in flight: steps of 3, 3, 2 requests, each request in every third step."""
    s = make_scheduler(max_num_batched_tokens=64, max_concurrent_batches=3)
    for i in range(8):
        s.add_request(make_request(4, first_token=100 + 10 * i, request_id=f"r{i}", max_tokens=6, ignore_eos=True))
    driver = PipelineDriver(s, lambda output: sample_for(s, output))
    for _ in range(10):  # (the first fills the pipeline: three steps)
        driver.step()
    shares = [sorted(o.num_scheduled_tokens) for o in driver.outputs[:12]]
    assert [len(share) for share in shares] == [3, 3, 2] * 4
    assert shares[:3] == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6", "r7"]] and shares[3:6] == shares[:3]
    driver.drive()
    assert s.kv_cache_manager.usage == 0


def _fuzz(depth, seed):
    """A seeded workload with a tight pool (preemptions) and up to `depth` steps in flight: its driver and the
    tokens each request got."""
    rng = random.Random(seed)
    s = make_scheduler(
        num_blocks=10, block_size=2, max_num_seqs=4, max_num_batched_tokens=10, max_concurrent_batches=depth
    )
    runner = RecordingRunner(2, lambda request_id, token_ids: 10 + len(token_ids) % 3, track_completion=True)
    driver = PipelineDriver(s, runner.execute, complete=runner.complete)
    requests = []
    for i in range(12):
        prompt = [rng.choice([10, 11]) for _ in range(rng.randint(1, 10))]
        requests.append(make_request(prompt, request_id=f"r{i}", max_tokens=rng.randint(1, 12), ignore_eos=True))
        s.add_request(requests[-1])
        driver.step()
    driver.drive()
    assert s.kv_cache_manager.usage == 0
    return driver, s.num_preemptions, [r.output_token_ids for r in requests]


def test_steps_in_flight_overlap_and_give_every_request_the_same_tokens():
    """The runner's tokens depend only on each sequence: however the steps overlap, outputs are the same."""
    num_preemptions = 0
    for seed in range(5):
        _, preempted, tokens = _fuzz(1, seed)
        num_preemptions += preempted
        for depth in (2, 3):
            driver, preempted, pipelined_tokens = _fuzz(depth, seed)
            num_preemptions += preempted
            assert pipelined_tokens == tokens and driver.num_overlapped > 0
    assert num_preemptions > 0
