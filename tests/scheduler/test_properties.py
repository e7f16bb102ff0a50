"""Random add / abort / finish / step sequences keep the block accounting sound."""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import RequestRejectedError, RequestStatus

from tests.scheduler.factories import EOS, check_invariants, make_request, make_scheduler, run_until_done, step

STOP_ID = 3
VOCAB = [EOS, STOP_ID, 10, 11, 12, 13]


@st.composite
def scheduler_setups(draw):
    max_num_seqs = draw(st.integers(1, 6))
    return dict(
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
        num_blocks=draw(st.integers(1, 40)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 48)),
        max_model_len=draw(st.integers(4, 96)),
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 1, 3, 8])),
    )


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.sampled_from([10, 11, 12]), min_size=0, max_size=24),  # few distinct tokens: shared prefixes
            st.integers(1, 24),  # max_tokens
            st.integers(0, 4),  # min_tokens
            st.booleans(),  # ignore_eos
            st.integers(-2, 2),  # priority
        ),
        st.tuples(st.just("step"), st.integers(0, 2**16)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=scheduler_setups(), ops=operations, tail_seed=st.integers(0, 2**16))
def test_random_workloads_keep_invariants_and_finish(setup, ops, tail_seed):
    s = make_scheduler(**setup)
    added = []
    ended_outside = set()  # aborted or finished by a (simulated) stop string
    for op in ops:
        kind = op[0]
        if kind == "add":
            _, prompt, max_tokens, min_tokens, ignore_eos, priority = op
            request = make_request(
                prompt,
                max_tokens=max_tokens,
                min_tokens=min(min_tokens, max_tokens),
                ignore_eos=ignore_eos,
                stop_token_ids=[STOP_ID],
                priority=priority,
            )
            total = len(prompt) + max_tokens
            feasible = (
                prompt
                and total <= setup["max_model_len"]
                and -(-(total - 1) // setup["block_size"]) <= setup["num_blocks"]
            )
            try:
                s.add_request(request)
            except RequestRejectedError:
                assert not feasible
                continue
            assert feasible
            added.append(request)
        elif kind == "step":
            rng = random.Random(op[1])
            step(s, token_fn=lambda r: rng.choice(VOCAB))
        elif added:
            target = added[op[1] % len(added)]
            ended_outside.add(target.request_id)
            if kind == "abort":
                s.abort([target.request_id])
                assert target.is_finished
            else:
                was_unfinished = not target.is_finished
                s.finish(target.request_id, stop_reason="stop-string")
                assert target.is_finished or not was_unfinished
        check_invariants(s)

    rng = random.Random(tail_seed)
    run_until_done(s, max_steps=5_000, token_fn=lambda r: rng.choice(VOCAB))
    for request in added:
        assert request.is_finished
        if request.status is RequestStatus.FINISHED_LENGTH_CAPPED:
            assert request.num_output_tokens == request.max_tokens or request.num_tokens == setup["max_model_len"]
        if request.request_id not in ended_outside:
            assert request.num_output_tokens >= 1
            if request.status is RequestStatus.FINISHED_STOPPED:
                assert request.num_output_tokens >= request.min_tokens
    assert s.kv_cache_manager.usage == 0
    assert s.kv_cache_manager.block_pool.num_free_blocks == setup["num_blocks"]
    stats = s.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries


@settings(max_examples=100, deadline=None)
@given(
    num_requests=st.integers(1, 12),
    prompt_len=st.integers(1, 20),
    max_tokens=st.integers(1, 20),
    num_blocks=st.integers(6, 30),
    seed=st.integers(0, 2**16),
)
def test_every_request_gets_all_its_tokens_when_it_fits(num_requests, prompt_len, max_tokens, num_blocks, seed):
    """Preemption and recompute never lose or duplicate output tokens."""
    s = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    if -(-(prompt_len + max_tokens - 1) // 4) > num_blocks:
        return
    rng = random.Random(seed)
    requests = [
        make_request([rng.choice([10, 11]) for _ in range(prompt_len)], max_tokens=max_tokens, ignore_eos=True)
        for _ in range(num_requests)
    ]
    for r in requests:
        s.add_request(r)
    run_until_done(s, token_fn=lambda r: 20 + r.num_output_tokens)
    for r in requests:
        assert r.output_token_ids == [20 + i for i in range(max_tokens)]
    assert s.kv_cache_manager.usage == 0
