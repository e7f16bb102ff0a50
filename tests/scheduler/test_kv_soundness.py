"""Every token a request counts as computed was written, by an earlier step, for exactly its tokens.

The scheduler is driven with `RecordingRunner`, which follows only the step messages
and keeps a ledger of every KV slot written; it raises on any read of a slot that
does not hold the reading request's own prefix.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from scheduler import RequestRejectedError

from tests.scheduler.factories import check_invariants, check_step_output, make_request, make_scheduler
from tests.scheduler.pipeline_driver import PipelineDriver
from tests.scheduler.recording_runner import RecordingRunner, UnwrittenKVError

STOP_ID = 3


def drive(scheduler, runner, max_steps=5_000):
    """Steps until nothing is left, checking the block accounting after every step."""
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests:
            return
        one_step(scheduler, runner)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def one_step(scheduler, runner):
    output = scheduler.schedule()
    check_step_output(scheduler, output)
    scheduler.update_from_output(output, runner.execute(output))
    check_invariants(scheduler)
    return output


def test_a_block_filled_in_a_step_that_preempts_its_owner_is_never_a_hit():
    """The reported bug (priority policy): r1 fills block 1 by decoding in the step where r2's chunk
    preempts r1 and then itself.

    Before the fix the block entered the prefix-cache index when it was scheduled, stayed
    there after r1 was freed, and a request extending r1's tokens read its unwritten slot.
    """
    s = make_scheduler(
        num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=15, max_model_len=64, policy="priority"
    )
    sampled = iter([10, 10, 10, 11])
    runner = RecordingRunner(4, lambda request_id, token_ids: next(sampled, 12))
    r1 = make_request([11, 12, 10, 12, 11, 11], request_id="r1", max_tokens=8, priority=0, ignore_eos=True)
    s.add_request(r1)
    one_step(s, runner)  # r1's prompt
    s.add_request(
        make_request(
            [12, 10, 12, 11, 11, 10, 12, 12, 12, 12, 10, 10],
            request_id="r0",
            max_tokens=3,
            priority=-2,
            ignore_eos=True,
        )
    )
    s.add_request(
        make_request(
            [11, 10, 12, 11, 11, 12, 12, 12, 12, 12, 12, 11, 12, 10, 12, 12, 12, 10, 10],
            request_id="r2",
            max_tokens=7,
            priority=-1,
            ignore_eos=True,
        )
    )
    one_step(s, runner)  # r1 decodes, r0 prefills, r2 gets a 2-token first chunk
    # Before the admission fix, r2 got a 2-token first chunk here and in the next step, as
    # r1 decoded into the end of block 1, r2's next chunk preempted r1 and then r2 itself.
    one_step(s, runner)
    probe = make_request(r1.all_token_ids + [12], request_id="probe", max_tokens=1, priority=-3, ignore_eos=True)
    s.add_request(probe)
    drive(s, runner)
    assert s.kv_cache_manager.usage == 0


def test_a_decode_that_preempts_a_request_which_filled_a_block_earlier_in_the_step():
    """The same bug through today's admission: v's decode fills its block 1, then h's decode,
    later in the same step, needs a block and preempts v (the lower priority). Block 1 was
    never written and must not be a hit for a request extending v's tokens."""
    s = make_scheduler(
        num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, policy="priority"
    )
    runner = RecordingRunner(4, lambda request_id, token_ids: 50 if request_id == "v" else 60)
    v = make_request(list(range(10, 16)), request_id="v", max_tokens=6, priority=5, ignore_eos=True)
    h = make_request(list(range(20, 28)), request_id="h", max_tokens=2, priority=0, ignore_eos=True)
    s.add_request(v)
    one_step(s, runner)  # v's prompt
    s.add_request(h)
    one_step(s, runner)  # v decodes; h's prompt (8 tokens)
    output = one_step(s, runner)  # v fills its block 1, then h's decode preempts v
    assert output.preempted_request_ids == {"v"}
    s.add_request(make_request(v.all_token_ids + [1], request_id="probe", max_tokens=1, priority=-3, ignore_eos=True))
    drive(s, runner)
    assert s.kv_cache_manager.usage == 0


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_tight_pools_with_aborts_between_schedule_and_update(depth):
    """Seeded fuzzing where decodes run pools dry, so requests are preempted in the very step
    that fills their blocks (counted: the test fails if that never happens), with aborts
    arriving between `schedule` and `update_from_output` and request ids reused at once.

    With `depth` (max_concurrent_batches) > 1, up to that many steps are in flight: requests are
    also aborted while their step is in flight, and a request that needs blocks waits when the only
    victims are in flight (both counted)."""
    dropped_pending = dropped_in_flight = waited = 0
    for seed in range(250):
        rng = random.Random(seed)
        block_size = rng.choice([2, 4])
        windows = rng.choice([(None,), (None,), (None, rng.randint(1, 9)), (rng.randint(1, 9),)])
        s = make_scheduler(
            num_blocks=rng.randint(3, 10),
            block_size=block_size,
            max_num_seqs=rng.randint(2, 4),
            max_num_batched_tokens=rng.randint(4, 16),
            max_model_len=64,
            policy=rng.choice(["fcfs", "priority"]),
            kv_group_windows=windows,
            max_concurrent_batches=depth,
        )
        kv = s.kv_cache_manager
        free, pick_victim = kv.free, s._pick_victim

        def counting_free(request, free=free, kv=kv, s=s):
            nonlocal dropped_pending, dropped_in_flight
            held = {b.block_id for blocks in kv.get_blocks(request.request_id) for b in blocks}
            dropped_pending += bool(held & set(kv._pending_step))
            dropped_in_flight += request.request_id in s._in_flight
            free(request)

        def counting_pick_victim(requester, pick_victim=pick_victim):
            nonlocal waited
            victim = pick_victim(requester)
            waited += victim is None
            return victim

        kv.free = counting_free
        s._pick_victim = counting_pick_victim
        runner = RecordingRunner(
            block_size,
            lambda request_id, token_ids: rng.choice([10, 11]),
            group_windows=windows,
            null_block=kv.null_block.block_id,
            track_completion=True,
        )
        driver = PipelineDriver(s, runner.execute, complete=runner.complete)
        for _ in range(40):
            if rng.random() < 0.4:
                live = list(s.requests.values())
                prompt = (
                    [rng.choice([10, 11]) for _ in range(rng.randint(1, 12))]
                    if not live or rng.random() < 0.5
                    else rng.choice(live).all_token_ids + [10]
                )
                request = make_request(
                    prompt,
                    request_id=f"r{rng.randint(0, 5)}",
                    max_tokens=rng.randint(1, 30),
                    priority=rng.randint(-2, 2),
                    ignore_eos=True,
                )
                if request.request_id not in s.requests:
                    try:
                        s.add_request(request)
                    except RequestRejectedError:
                        pass
            if len(driver.in_flight) < depth:
                driver.schedule()
            if s.requests and rng.random() < 0.1:
                s.abort([rng.choice(list(s.requests))])
            if driver.in_flight and (len(driver.in_flight) >= depth or rng.random() < 0.3):
                driver.update_oldest()
        driver.drive()
        assert kv.usage == 0 and s.num_outstanding_steps == 0
    assert dropped_pending > 0
    if depth > 1:
        assert dropped_in_flight > 0 and waited > 0


@st.composite
def setups(draw):
    max_num_seqs = draw(st.integers(1, 5))
    return dict(
        block_size=draw(st.sampled_from([1, 2, 4])),
        num_blocks=draw(st.integers(3, 24)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 20)),
        max_model_len=64,
        enable_prefix_caching=draw(st.booleans() | st.just(True)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        # layer groups: full attention only, or with sliding-window groups (whose blocks behind the window
        # are freed, and whose hits need only the window's blocks)
        kv_group_windows=draw(st.sampled_from([(None,), (None, "w"), ("w",), ("w", None, "w")])),  # "w": `window`
        window=draw(st.integers(1, 12)),
        # a hybrid model's snapshots of recurrent states (with prefix caching and full attention only)
        num_state_snapshots=draw(st.sampled_from([0, 0, 1, 3, 8])),
    )


def _scheduler_and_runner(setup, token_fn, depth=1):
    """The scheduler of a drawn setup and a RecordingRunner that knows its groups."""
    setup = dict(setup)
    window = setup.pop("window")
    windows = tuple(window if w == "w" else w for w in setup.pop("kv_group_windows"))
    if any(windows) or not setup["enable_prefix_caching"]:
        setup["num_state_snapshots"] = 0
    s = make_scheduler(**setup, kv_group_windows=windows, max_concurrent_batches=depth)
    runner = RecordingRunner(
        setup["block_size"],
        token_fn,
        group_windows=windows,
        null_block=s.kv_cache_manager.null_block.block_id,
        track_completion=True,
        track_states=bool(setup["num_state_snapshots"]),
    )
    return s, runner


operations = st.lists(
    st.one_of(
        # a new prompt of few distinct tokens (shared prefixes by chance)
        st.tuples(
            st.just("add"),
            st.lists(st.sampled_from([10, 11]), min_size=1, max_size=20),
            st.integers(1, 30),
            st.integers(-2, 2),
        ),
        # a prompt extending a live request's tokens so far (a prefix hit on its blocks, if written)
        st.tuples(st.just("extend"), st.integers(0, 50), st.integers(0, 3), st.integers(1, 6), st.integers(-3, 2)),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
    ),
    max_size=50,
)


def check_computed_tokens_were_written(setup, ops, seed, depth):
    """Both policies, preemption, chunked prefill, prefix hits, aborts and stop-string finishes, with and
    without sliding-window layer groups, with up to `depth` steps in flight (aborts and finishes land
    between steps, while the newer ones are in flight)."""
    rng = random.Random(seed)
    vocab = [10] * 7 + [11] * 8 + [STOP_ID]  # a stop token now and then: most requests grow long
    s, runner = _scheduler_and_runner(setup, lambda request_id, token_ids: rng.choice(vocab), depth)
    driver = PipelineDriver(s, runner.execute, complete=runner.complete)
    added = []
    for op in ops:
        kind = op[0]
        if kind in ("add", "extend"):
            if kind == "add":
                _, prompt, max_tokens, priority = op
            else:
                _, index, extra, max_tokens, priority = op
                live = list(s.requests.values())
                if not live:
                    continue
                prompt = live[index % len(live)].all_token_ids + [10] * extra
            request = make_request(prompt, max_tokens=max_tokens, priority=priority, stop_token_ids=[STOP_ID])
            try:
                s.add_request(request)
            except RequestRejectedError:
                continue
            added.append(request)
        elif kind == "step":
            for _ in range(op[1]):
                driver.step()
        elif added:
            ended_id = added[op[1] % len(added)].request_id
            if kind == "abort":
                s.abort([ended_id])
            else:
                s.finish(ended_id, stop_reason="stop-string")
    driver.drive()
    assert all(r.is_finished for r in added)
    assert s.kv_cache_manager.usage == 0 and s.kv_cache_manager.num_pending_blocks == 0
    target(float(s.num_preemptions), label="preemptions")  # steer the search to pools that run dry


_property = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=400, **_property)
@given(setup=setups(), ops=operations, seed=st.integers(0, 2**16))
def test_computed_tokens_were_written_for_exactly_those_tokens(setup, ops, seed):
    check_computed_tokens_were_written(setup, ops, seed, depth=1)


@settings(max_examples=120, **_property)
@given(setup=setups(), ops=operations, seed=st.integers(0, 2**16), depth=st.sampled_from([2, 3]))
def test_computed_tokens_were_written_with_steps_in_flight(setup, ops, seed, depth):
    check_computed_tokens_were_written(setup, ops, seed, depth)


def test_the_recording_runner_catches_a_read_of_unwritten_kv():
    """The ledger is not vacuous: a hit on a block nobody wrote is reported."""
    s = make_scheduler(num_blocks=8, block_size=4)
    runner = RecordingRunner(4)
    a = make_request(list(range(9)), max_tokens=2)
    s.add_request(a)
    one_step(s, runner)
    runner.slots.clear()  # as if the step's writes were lost
    b = make_request(list(range(9)) + [1], max_tokens=1)
    s.add_request(b)
    output = s.schedule()
    assert output.num_computed_tokens[b.request_id] == 8
    with pytest.raises(UnwrittenKVError, match="never written"):
        runner.execute(output)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("caching", [False, True])
def test_long_prompts_in_a_pool_just_larger_than_one_are_admitted_whole_and_never_thrash(policy, caching):
    """Admission reserves the whole rest of the prompt, not just its first chunk.

    Admitted with room for one chunk only, a second long prompt takes the blocks the
    first one's later chunks need, and preemption throws work away, again and again
    (before the fix, without prefix caching: 24 preemptions and 1,184 tokens computed
    for 824).
    """
    s = make_scheduler(
        num_blocks=32,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        max_model_len=128,
        policy=policy,
        enable_prefix_caching=caching,
    )
    runner = RecordingRunner(4)
    requests = [
        make_request(96, first_token=100 + 200 * i, max_tokens=8, ignore_eos=True, priority=i % 3) for i in range(8)
    ]
    for request in requests:
        s.add_request(request)
    drive(s, runner)
    assert all(r.num_output_tokens == 8 for r in requests)
    assert s.num_preemptions == 0
    # Nothing was computed twice: 96 prompt tokens and 7 fed-back outputs per request.
    assert runner.num_tokens_written == len(requests) * 103


def test_an_update_for_a_step_that_is_not_the_latest_is_refused():
    """Pending blocks belong to the latest scheduled step: an older step's update must not index them."""
    s = make_scheduler()
    s.add_request(make_request(9))
    stale = s.schedule()
    s.schedule()  # scheduled again before the first completed
    with pytest.raises(ValueError, match="not the oldest in flight"):
        s.update_from_output(stale, {})
