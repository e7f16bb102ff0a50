"""Prefix caching for hybrid models: a hit reaches only as far as a snapshot of the recurrent states, which the step
restores; snapshots are taken at the junction of a shared prefix, at the prompt's last boundary and at the
sequence's end, pending until their step has run, and evicted least recently used first.

The scheduler is driven with `RecordingRunner(track_states=True)`, which plays the states from the step messages
alone and raises when a request continues from a state of other tokens than its own."""

import random

import pytest

from scheduler import RequestRejectedError
from scheduler.block_hash import BlockHash
from scheduler.state_snapshots import StateSnapshots

from tests.scheduler.factories import make_request, make_scheduler
from tests.scheduler.pipeline_driver import PipelineDriver
from tests.scheduler.recording_runner import RecordingRunner, UnwrittenKVError

BLOCK = 4


def _hybrid(**overrides):
    settings = dict(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=64, num_state_snapshots=4)
    scheduler = make_scheduler(**{**settings, **overrides})
    runner = RecordingRunner(BLOCK, track_states=True, track_completion=True)
    return scheduler, runner


def _step(scheduler, runner):
    output = scheduler.schedule()
    sampled = runner.execute(output)
    scheduler.update_from_output(output, sampled)
    runner.complete(output.step_id)
    return output


def _run(scheduler, runner, *requests):
    outputs = []
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests:
        outputs.append(_step(scheduler, runner))
    return outputs


def _keys(*values):
    return [BlockHash(bytes([v]), ()) for v in values]


def test_a_hit_stops_at_the_last_block_with_a_snapshot():
    snapshots = StateSnapshots(2, BLOCK)
    hashes = _keys(1, 2, 3, 4)
    assert snapshots.longest_hit(hashes, 4) == 0
    request = make_request(list(range(17)))
    request.block_hashes.extend(hashes)
    snapshots.admit(request, 0, 0)
    ops = snapshots.take_ops(1, [(request, 0, 10)])
    assert ops.saves == (), "no save before the point the prompt reaches (its last boundary, 16)"
    ops = snapshots.take_ops(2, [(request, 10, 7)])
    assert ops.saves == ((request.request_id, 16, 0),)
    assert snapshots.longest_hit(hashes, 4) == 0, "pending until its step has run"
    snapshots.commit(2)
    assert snapshots.longest_hit(hashes, 4) == 4 and snapshots.longest_hit(hashes, 3) == 0


def test_slots_are_evicted_least_recently_used_first_and_a_full_index_skips_saves():
    snapshots = StateSnapshots(2, BLOCK)
    requests = []
    for i in range(3):
        request = make_request(list(range(i * 10, i * 10 + 5)))
        request.block_hashes.extend(_keys(10 * i + 1))
        snapshots.admit(request, 0, 0)
        requests.append(request)
    a, b, c = requests
    assert snapshots.take_ops(1, [(a, 0, 5), (b, 0, 5)]).saves == (("%s" % a.request_id, 4, 0), (b.request_id, 4, 1))
    assert snapshots.take_ops(2, [(c, 0, 5)]).saves == (), "both slots pending: nothing to evict"
    snapshots.commit(1)
    d = make_request(list(range(5)))
    d.block_hashes.extend(a.block_hashes)
    assert snapshots.longest_hit(d.block_hashes, 1) == 1
    snapshots.admit(d, 1, 1)  # (a restore touches a's slot: b's is now the least recently used)
    assert snapshots.take_ops(3, []).restores == ((d.request_id, 0),)
    c2 = make_request(list(range(20, 25)))
    c2.block_hashes.extend(c.block_hashes)
    snapshots.admit(c2, 0, 0)
    assert snapshots.take_ops(4, [(c2, 0, 5)]).saves == ((c2.request_id, 4, 1),)
    snapshots.commit(4)
    assert snapshots.longest_hit(b.block_hashes, 1) == 0 and snapshots.longest_hit(a.block_hashes, 1) == 1


def test_a_requests_last_boundary_is_evicted_first_once_it_keeps_an_end():
    """The prompt's last boundary serves the same prompt again, which comes soon if at all; a chat's next turn needs
    the end: once a request keeps an end, its last boundary goes first, even just after a restore touched it."""
    snapshots = StateSnapshots(3, BLOCK)
    a = make_request(list(range(6)))  # last boundary 4
    a.block_hashes.extend(_keys(1, 2))
    snapshots.admit(a, 0, 0)
    assert snapshots.take_ops(1, [(a, 0, 6)]).saves == ((a.request_id, 4, 0),)
    snapshots.commit(1)
    x = make_request(list(range(100, 105)))
    x.block_hashes.extend(_keys(9))
    snapshots.admit(x, 0, 0)
    assert snapshots.take_ops(2, [(x, 0, 5)]).saves == ((x.request_id, 4, 1),)
    snapshots.commit(2)
    again = make_request(list(range(6)))
    again.block_hashes.extend(a.block_hashes)
    snapshots.admit(again, 1, 1)  # (restores a's last boundary: now the most recently used)
    a.append_output_token(7), a.append_output_token(8)
    assert snapshots.take_ops(3, [(a, 7, 1)]).saves == ((a.request_id, 8, 2),)  # its end (demoting its last)
    snapshots.commit(3)
    y = make_request(list(range(200, 205)))
    y.block_hashes.extend(_keys(8))
    snapshots.admit(y, 0, 0)
    assert snapshots.take_ops(4, [(y, 0, 5)]).saves == ((y.request_id, 4, 0),), "a's last boundary evicted"
    snapshots.commit(4)
    assert snapshots.longest_hit(x.block_hashes, 1) == 1 and snapshots.longest_hit(a.block_hashes, 1) == 0
    assert snapshots.longest_hit(a.block_hashes, 2) == 2


def test_pending_saves_of_a_released_request_or_a_discarded_step_free_their_slots():
    snapshots = StateSnapshots(1, BLOCK)
    a = make_request(list(range(5)))
    a.block_hashes.extend(_keys(1))
    snapshots.admit(a, 0, 0)
    assert snapshots.take_ops(1, [(a, 0, 5)]).saves
    snapshots.release(a.request_id)
    snapshots.commit(1)
    assert snapshots.num_indexed == 0
    b = make_request(list(range(5)))
    b.block_hashes.extend(_keys(2))
    snapshots.admit(b, 0, 0)
    assert snapshots.take_ops(2, [(b, 0, 5)]).saves == ((b.request_id, 4, 0),), "the slot came back"
    snapshots.discard()
    snapshots.commit(2)
    assert snapshots.num_indexed == 0
    snapshots.admit(b, 0, 0)
    assert snapshots.take_ops(3, [(b, 0, 5)]).saves == ((b.request_id, 4, 0),)


def test_the_same_prompt_again_restores_the_last_boundary():
    s, runner = _hybrid()
    prompt = list(range(20, 38))  # 18 tokens: the last boundary before its final token is 16
    _run(s, runner, make_request(prompt, max_tokens=2, ignore_eos=True))
    again = make_request(prompt, max_tokens=2, ignore_eos=True)
    first, *_ = _run(s, runner, again)
    assert first.num_computed_tokens[again.request_id] == 16
    assert first.state_restores and again.num_cached_tokens == 16
    assert runner.num_restores == 1


def test_a_chats_next_turn_restores_the_previous_turns_end():
    """The end is kept at every block a decode completes, each replacing the last (one slot per request)."""
    s, runner = _hybrid(num_state_snapshots=3)
    turn = make_request(list(range(20, 26)), max_tokens=13, ignore_eos=True)
    outputs = _run(s, runner, turn)
    ends = [position for o in outputs for _, position, _ in o.state_saves]
    assert ends == [4, 8, 12, 16]  # (4: the prompt's last boundary, inside its chunk; then each end)
    slots = {slot for o in outputs[1:] for _, _, slot in o.state_saves}
    assert len(slots) == 1, "each end replaces the previous in the request's slot"
    follow_up = make_request(turn.all_token_ids + [40, 41, 42], max_tokens=2, ignore_eos=True)
    first, *_ = _run(s, runner, follow_up)
    assert first.num_computed_tokens[follow_up.request_id] == 16 and first.state_restores


def test_the_junction_of_a_shared_prefix_is_kept_for_the_next_request():
    """The second request sharing a system prompt finds its blocks but no state there (nobody stopped there): it
    keeps one, inside its prompt chunk, and the third restores it."""
    s, runner = _hybrid()
    system = list(range(50, 63))  # 13 tokens: 3 full blocks
    _run(s, runner, make_request(system + [1, 2, 3, 4, 5, 6, 7], max_tokens=1, ignore_eos=True))  # (kept: 16)
    second = make_request(system + [4, 5, 6, 7, 8, 9], max_tokens=1, ignore_eos=True)  # (its last boundary: 16)
    (first, *_) = _run(s, runner, second)
    assert first.num_computed_tokens[second.request_id] == 0
    positions = [(i, position) for i, position, _ in first.state_saves]
    assert positions == [(second.request_id, 12), (second.request_id, 16)], "the junction, inside its chunk"
    third = make_request(system + [6, 7, 8, 9], max_tokens=1, ignore_eos=True)
    (first, *_) = _run(s, runner, third)
    assert first.num_computed_tokens[third.request_id] == 12 and first.state_restores


def test_identical_prompts_arriving_together_wait_for_the_first_and_restore_its_snapshot():
    s, runner = _hybrid()
    prompt = list(range(30, 40))
    a, b = (make_request(prompt, max_tokens=3, ignore_eos=True) for _ in range(2))
    outputs = _run(s, runner, a, b)
    assert set(outputs[0].num_scheduled_tokens) == {a.request_id}
    assert outputs[1].num_computed_tokens[b.request_id] == 8 and outputs[1].state_restores


def test_the_recording_runner_catches_a_restore_of_another_prefix():
    """The state ledger is not vacuous: a snapshot index pointing at another prefix's slot is reported."""
    s, runner = _hybrid()
    _run(s, runner, make_request(list(range(10)), max_tokens=1, ignore_eos=True))
    _run(s, runner, make_request(list(range(100, 110)), max_tokens=1, ignore_eos=True))
    index = s.kv_cache_manager.snapshots._index
    first, second = list(index)
    index[first], index[second] = index[second], index[first]
    s.add_request(make_request(list(range(10)), max_tokens=1, ignore_eos=True))
    with pytest.raises(UnwrittenKVError, match="recurrent state of 8 other tokens"):
        _step(s, runner)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_snapshots_under_preemption_aborts_and_steps_in_flight(depth):
    """Seeded fuzzing over small pools and few slots: chats that extend live requests, shared prefixes, repeats,
    preemptions and aborts, up to `depth` steps in flight; every continued state is the request's own (the
    recording runner), restores happen, and no slot is lost."""
    restores = saves = 0
    for seed in range(120):
        rng = random.Random(seed)
        s = make_scheduler(
            num_blocks=rng.randint(6, 14),
            block_size=rng.choice([2, 4]),
            max_num_seqs=rng.randint(2, 4),
            max_num_batched_tokens=rng.randint(4, 16),
            max_model_len=64,
            max_concurrent_batches=depth,
            num_state_snapshots=rng.randint(1, 4),
        )
        runner = RecordingRunner(
            s.block_size, lambda request_id, token_ids: rng.choice([10, 11]), track_completion=True, track_states=True
        )
        driver = PipelineDriver(s, runner.execute, complete=runner.complete)
        history: list[list[int]] = []
        for _ in range(40):
            if rng.random() < 0.4:
                live = [r.all_token_ids for r in s.requests.values()] + history[-3:]
                prompt = (
                    [rng.choice([10, 11]) for _ in range(rng.randint(1, 12))]
                    if not live or rng.random() < 0.4
                    else list(rng.choice(live))[: rng.randint(1, 40)] + [10] * rng.randint(0, 3)
                )
                request = make_request(prompt, max_tokens=rng.randint(1, 20), ignore_eos=True)
                try:
                    s.add_request(request)
                    history.append(request.all_token_ids)
                except RequestRejectedError:
                    pass
            if len(driver.in_flight) < depth:
                output = driver.schedule()
                restores += len(output.state_restores)
                saves += len(output.state_saves)
            if s.requests and rng.random() < 0.1:
                s.abort([rng.choice(list(s.requests))])
            if driver.in_flight and (len(driver.in_flight) >= depth or rng.random() < 0.3):
                driver.update_oldest()
        driver.drive()
        snapshots = s.kv_cache_manager.snapshots
        assert snapshots is not None and not snapshots._pending and not snapshots._points
        assert len(snapshots._free) + len(snapshots._lru) == snapshots.num_slots
        assert s.kv_cache_manager.usage == 0
    assert restores > 50 and saves > 200


def test_a_draft_proposer_is_refused_beside_snapshots():
    """A rejected draft cannot be taken back out of a recurrent state (the engine refuses speculative decoding for
    hybrid models by name first)."""
    from tests.scheduler.test_spec_decode import FixedProposer

    with pytest.raises(ValueError, match="proposer"):
        make_scheduler(num_state_snapshots=2, proposer=FixedProposer(2))
