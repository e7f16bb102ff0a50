import pytest

from scheduler import (
    ContextLengthExceededError,
    DuplicateRequestIdError,
    EmptyPromptError,
    KVCacheTooSmallError,
    RequestRejectedError,
    RequestStatus,
)

from tests.scheduler.factories import (
    EOS,
    check_invariants,
    make_request,
    make_scheduler,
    run_until_done,
    step,
)


def test_single_request_runs_to_max_tokens():
    s = make_scheduler()
    r = make_request(10, max_tokens=3)
    s.add_request(r)
    out, results = step(s)
    assert out.num_scheduled_tokens == {r.request_id: 10}
    assert out.new_requests[0].token_ids.tolist() == r.prompt_token_ids
    assert results[0].new_token_ids == [7]
    run_until_done(s)
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.status.finish_reason == "length"
    assert r.output_token_ids == [7, 7, 7]
    assert s.kv_cache_manager.usage == 0


def test_status_order_and_finish_reasons():
    assert [s.is_finished for s in RequestStatus] == [False, False, False, True, True, True]
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.RUNNING.finish_reason is None


def test_chunked_prefill_splits_long_prompt_while_decodes_flow():
    s = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4, num_blocks=64)
    short = make_request(4, max_tokens=20, ignore_eos=True)
    s.add_request(short)
    step(s)  # short's prompt
    long = make_request(40, max_tokens=2, first_token=300)
    s.add_request(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out, _ = step(s)
        assert out.num_scheduled_tokens[short.request_id] == 1  # the decode never stalls
        chunks.append(out.num_scheduled_tokens[long.request_id])
    assert chunks == [15, 15, 10]
    assert long.num_output_tokens == 1  # sampled once, at the end of the last chunk
    run_until_done(s)


def test_long_prefill_token_threshold_lets_a_short_prompt_in_beside_a_long_one():
    """vLLM's long_prefill_token_threshold: a long prompt computes at most that many tokens a step, so a prompt
    arriving behind it shares the step instead of waiting until the long one is done."""
    for threshold, expected_long, short_waits in ((0, [64, 64, 32], True), (24, [24] * 6 + [16], False)):
        s = make_scheduler(
            max_num_batched_tokens=64, max_num_seqs=4, num_blocks=64, long_prefill_token_threshold=threshold
        )
        long = make_request(160, max_tokens=2, first_token=300)
        short = make_request(6, max_tokens=2)
        s.add_request(long)
        s.add_request(short)
        chunks, short_started = [], None
        while long.num_computed_tokens < long.num_prompt_tokens:
            out, _ = step(s)
            chunks.append(out.num_scheduled_tokens[long.request_id])
            if short_started is None and short.request_id in out.num_scheduled_tokens:
                short_started = len(chunks)
        assert chunks == expected_long
        assert (short_started == len(chunks)) is short_waits and short_started is not None
        run_until_done(s)
        assert s.kv_cache_manager.block_pool.num_free_blocks == 64


def test_decodes_go_before_running_prompt_chunks():
    """Whatever the order of the running list, every decode is scheduled before prompt chunks."""
    s = make_scheduler(max_num_batched_tokens=16, max_num_seqs=8, num_blocks=64)
    decoders = [make_request(2, max_tokens=10, first_token=500 + 10 * i) for i in range(3)]
    long = make_request(60, max_tokens=2)
    for r in decoders + [long]:
        s.add_request(r)
    out, _ = step(s)
    assert out.num_scheduled_tokens[long.request_id] == 10
    s.running.sort(key=lambda r: r is not long)  # the prompt first in the running list
    out, _ = step(s)
    assert [out.num_scheduled_tokens[r.request_id] for r in decoders] == [1, 1, 1]
    assert out.num_scheduled_tokens[long.request_id] == 13
    run_until_done(s)


def test_max_num_seqs_limits_running_batch():
    s = make_scheduler(max_num_seqs=2, num_blocks=64)
    requests = [make_request(4, first_token=100 * i) for i in range(5)]
    for r in requests:
        s.add_request(r)
    out, _ = step(s)
    assert len(out.num_scheduled_tokens) == 2
    run_until_done(s)
    assert all(r.status is RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)


def test_fcfs_admission_order():
    s = make_scheduler(max_num_seqs=1)
    requests = [make_request(4, max_tokens=1, first_token=100 * i) for i in range(3)]
    for r in requests:
        s.add_request(r)
    order = [next(iter(out.num_scheduled_tokens)) for out in run_until_done(s)]
    assert order == [r.request_id for r in requests]


def test_priority_policy_admits_lower_value_first():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    low = make_request(4, max_tokens=1, priority=5, arrival_time=1.0)
    high = make_request(4, max_tokens=1, priority=-1, arrival_time=2.0)
    mid_a = make_request(4, max_tokens=1, priority=0, arrival_time=3.0)
    mid_b = make_request(4, max_tokens=1, priority=0, arrival_time=4.0)
    for r in (low, high, mid_b, mid_a):
        s.add_request(r)
    order = [next(iter(out.num_scheduled_tokens)) for out in run_until_done(s)]
    assert order == [high.request_id, mid_a.request_id, mid_b.request_id, low.request_id]


def test_preemption_frees_latest_admitted_and_recomputes():
    # 6 blocks of 4 tokens; two requests of 8-token prompts each growing to 20 tokens.
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, enable_prefix_caching=False)
    first = make_request(8, max_tokens=12, ignore_eos=True)
    second = make_request(8, max_tokens=12, ignore_eos=True, first_token=400)
    s.add_request(first)
    s.add_request(second)
    preempted_at = None
    resumed = None
    outputs = []
    while s.has_unfinished_requests:
        out, _ = step(s)
        outputs.append(out)
        if out.preempted_request_ids and preempted_at is None:
            preempted_at = len(outputs)
            assert out.preempted_request_ids == {second.request_id}
            assert second.status is RequestStatus.PREEMPTED
            assert second.num_computed_tokens == 0
            tokens_before = list(second.all_token_ids)
        for new in out.new_requests:
            if preempted_at is not None and new.request_id == second.request_id:
                resumed = new
    assert preempted_at is not None and s.num_preemptions >= 1
    assert resumed is not None and list(resumed.token_ids) == tokens_before
    assert resumed.num_computed_tokens == 0
    assert first.num_output_tokens == 12 and second.num_output_tokens == 12
    assert s.kv_cache_manager.usage == 0


def test_preemption_under_priority_takes_lowest_priority():
    s = make_scheduler(num_blocks=6, block_size=4, policy="priority", enable_prefix_caching=False)
    important = make_request(8, max_tokens=12, ignore_eos=True, priority=0, arrival_time=2.0)
    minor = make_request(8, max_tokens=12, ignore_eos=True, priority=9, arrival_time=1.0, first_token=400)
    s.add_request(minor)
    step(s)
    s.add_request(important)
    while not s.num_preemptions:
        step(s)
    assert minor.status is RequestStatus.PREEMPTED
    run_until_done(s)


def test_many_requests_over_small_pool_all_finish():
    s = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    requests = [make_request(6 + i, max_tokens=8 + i, ignore_eos=True, first_token=50 * i) for i in range(12)]
    for r in requests:
        s.add_request(r)
    run_until_done(s)
    assert s.num_preemptions > 0
    assert all(r.num_output_tokens == r.max_tokens for r in requests)
    assert s.kv_cache_manager.usage == 0


@pytest.mark.parametrize("state", ["waiting", "running_prefill", "running_decode", "preempted"])
def test_abort_in_each_state_frees_everything(state):
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=False)
    victim = make_request(12 if state == "running_prefill" else 4, max_tokens=12, ignore_eos=True)
    other = make_request(8, max_tokens=12, ignore_eos=True, first_token=400)
    if state == "preempted":
        s.add_request(other)
        step(s)
        s.add_request(victim)
        while victim.status is not RequestStatus.PREEMPTED:
            step(s)
    elif state == "waiting":
        s.add_request(victim)
    else:
        s.add_request(victim)
        step(s)
        if state == "running_decode":
            step(s)
            assert victim.num_output_tokens >= 1
        else:
            assert victim.num_computed_tokens < victim.num_prompt_tokens
    assert s.abort([victim.request_id]) == [victim]
    assert victim.status is RequestStatus.FINISHED_ABORTED
    assert victim.request_id not in s.requests
    check_invariants(s)
    assert s.abort([victim.request_id, "never-seen"]) == []
    out, _ = step(s)
    assert victim.request_id in out.finished_request_ids
    run_until_done(s)
    assert s.kv_cache_manager.usage == 0


def test_abort_between_schedule_and_update_is_ignored():
    s = make_scheduler()
    r = make_request(4)
    s.add_request(r)
    out = s.schedule()
    s.abort([r.request_id])
    assert s.update_from_output(out, {r.request_id: [7]}) == []
    assert r.output_token_ids == [] and s.kv_cache_manager.usage == 0


def test_eos_stops_unless_ignored():
    s = make_scheduler()
    stops = make_request(4, max_tokens=5)
    ignores = make_request(4, max_tokens=5, ignore_eos=True, first_token=300)
    s.add_request(stops)
    s.add_request(ignores)
    run_until_done(s, token_fn=lambda r: EOS)
    assert stops.status is RequestStatus.FINISHED_STOPPED and stops.output_token_ids == [EOS]
    assert stops.stop_reason is None
    assert ignores.status is RequestStatus.FINISHED_LENGTH_CAPPED and ignores.num_output_tokens == 5


def test_stop_token_ids_set_stop_reason():
    s = make_scheduler()
    r = make_request(4, max_tokens=5, stop_token_ids=[42])
    s.add_request(r)
    run_until_done(s, token_fn=lambda req: 42 if req.num_output_tokens == 2 else 7)
    assert r.output_token_ids == [7, 7, 42]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == 42


def test_min_tokens_defers_eos_and_stop_ids():
    s = make_scheduler()
    r = make_request(4, max_tokens=6, min_tokens=3, stop_token_ids=[42])
    s.add_request(r)
    run_until_done(s, token_fn=lambda req: EOS if req.num_output_tokens % 2 else 42)
    assert r.output_token_ids == [42, EOS, 42]
    assert r.status is RequestStatus.FINISHED_STOPPED


def test_max_model_len_caps_generation():
    s = make_scheduler(max_model_len=12)
    r = make_request(10, max_tokens=2)
    s.add_request(r)
    run_until_done(s)
    assert r.num_tokens == 12 and r.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_multi_token_output_is_cut_at_stop():
    s = make_scheduler()
    r = make_request(4, max_tokens=10)
    s.add_request(r)
    out = s.schedule()
    (result,) = s.update_from_output(out, {r.request_id: [5, EOS, 6]})
    assert result.new_token_ids == [5, EOS] and result.finish_reason == "stop"
    assert r.output_token_ids == [5, EOS]


def test_finish_for_stop_string():
    s = make_scheduler()
    r = make_request(4, max_tokens=10)
    s.add_request(r)
    step(s)
    s.finish(r.request_id, stop_reason="###")
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == "###"
    assert s.kv_cache_manager.usage == 0 and not s.running
    with pytest.raises(ValueError):
        s.finish("x", RequestStatus.RUNNING)
    assert s.finish("unknown") is None


@pytest.mark.parametrize(
    "kwargs,error,field",
    [
        (dict(prompt=[]), EmptyPromptError, "prompt"),
        (dict(prompt=250, max_tokens=10), ContextLengthExceededError, "max_tokens"),
        (dict(prompt=300, max_tokens=1), ContextLengthExceededError, "prompt"),
        (dict(prompt=100, max_tokens=100), KVCacheTooSmallError, "max_tokens"),  # > whole pool
        (dict(prompt=170, max_tokens=1), KVCacheTooSmallError, "prompt"),  # the prompt alone > whole pool
    ],
)
def test_impossible_requests_are_refused(kwargs, error, field):
    s = make_scheduler(num_blocks=40, block_size=4, max_model_len=256)
    with pytest.raises(error) as info:
        s.add_request(make_request(**kwargs))
    assert isinstance(info.value, RequestRejectedError) and info.value.field == field
    assert not s.has_unfinished_requests


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prompt=4, max_tokens=0),
        dict(prompt=4, max_tokens=3, min_tokens=4),
        dict(prompt=4, max_tokens=3, min_tokens=-1),
    ],
)
def test_token_bounds_are_an_invariant_of_a_request(kwargs):
    """max_tokens and min_tokens are validated where a request is made (SamplingParams, and the engine where
    it resolves an unset max_tokens); a Request that breaks them is a bug, refused as one."""
    with pytest.raises(ValueError, match="min_tokens"):
        make_request(**kwargs)


def test_context_error_carries_both_numbers():
    s = make_scheduler(max_model_len=256, num_blocks=128)
    with pytest.raises(ContextLengthExceededError) as info:
        s.add_request(make_request(250, max_tokens=10))
    error = info.value
    assert (error.num_prompt_tokens, error.max_tokens, error.max_model_len, error.num_tokens) == (250, 10, 256, 260)


def test_kv_cache_error_carries_the_pool_size():
    s = make_scheduler(num_blocks=40, block_size=4, max_model_len=256)
    with pytest.raises(KVCacheTooSmallError) as info:
        s.add_request(make_request(100, max_tokens=100))
    error = info.value
    assert (error.num_blocks_needed, error.num_blocks, error.block_size) == (50, 40, 4)  # 199 slots / 4


def test_request_that_exactly_fills_pool_is_served():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    r = make_request(10, max_tokens=7, ignore_eos=True)  # 16 slots: the last token is never fed back
    s.add_request(r)
    run_until_done(s)
    assert r.num_output_tokens == 7


def test_duplicate_request_id_refused():
    s = make_scheduler()
    s.add_request(make_request(4, request_id="a"))
    with pytest.raises(DuplicateRequestIdError) as info:
        s.add_request(make_request(4, request_id="a"))
    assert info.value.request_id == "a" and info.value.field == "request_id"


def test_parallel_samples_share_prompt_blocks():
    """n > 1: the first child computes the prompt; the others wait one step and reuse its full blocks."""
    s = make_scheduler(num_blocks=32, block_size=4)
    prompt = list(range(100, 114))  # 3 full blocks + 2 tokens
    children = [make_request(prompt, max_tokens=3, request_id=f"cmpl-1-{i}") for i in range(3)]
    for c in children:
        s.add_request(c)
    out, _ = step(s)
    # Their next block is being computed by the first child: admitting them now would compute it twice.
    assert dict(out.num_scheduled_tokens) == {children[0].request_id: 14}
    out, _ = step(s)
    tables = [s.kv_cache_manager.get_block_ids(c.request_id)[0] for c in children]
    assert tables[0][:3] == tables[1][:3] == tables[2][:3]
    assert len({t[3] for t in tables}) == 3  # the partial last block is private
    assert [out.num_scheduled_tokens[c.request_id] for c in children] == [1, 2, 2]
    assert [out.num_computed_tokens[c.request_id] for c in children] == [14, 12, 12]
    shared = s.kv_cache_manager.get_blocks(children[0].request_id)[0][0]
    assert shared.ref_cnt == 3
    assert s.stats().prefix_cache_hits == 24
    run_until_done(s)
    assert s.kv_cache_manager.usage == 0


def test_prefix_cache_reuse_across_time_and_eviction():
    s = make_scheduler(num_blocks=8, block_size=4)
    a = make_request(list(range(12)), max_tokens=1)
    s.add_request(a)
    run_until_done(s)
    b = make_request(list(range(12)) + [99], max_tokens=1)
    s.add_request(b)
    out, _ = step(s)
    assert out.num_computed_tokens[b.request_id] == 12 and b.num_cached_tokens == 12
    run_until_done(s)
    # A long unrelated request evicts the cached blocks (LRU reallocation).
    c = make_request(list(range(500, 528)), max_tokens=1)
    s.add_request(c)
    run_until_done(s)
    d = make_request(list(range(12)) + [99], max_tokens=1)
    s.add_request(d)
    out, _ = step(s)
    assert out.num_computed_tokens[d.request_id] < 12


def test_stats_snapshot():
    s = make_scheduler(max_num_seqs=1)
    for i in range(3):
        s.add_request(make_request(4, first_token=10 * i))
    step(s)
    stats = s.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 2)
    assert 0 < stats.kv_cache_usage < 1
    assert stats.prefix_cache_queries == 4


def test_cached_tokens_are_the_prompt_hit_of_the_first_admission():
    # A request preempted after it has output tokens resumes by hitting its own freed (still indexed) blocks:
    # prompt and output. Its num_cached_tokens (usage's prompt_tokens_details.cached_tokens) must stay the
    # prompt tokens the prefix cache served at its first admission, never more than its prompt.
    s = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=4, enable_prefix_caching=True)
    first = make_request(4, max_tokens=6, ignore_eos=True)
    second = make_request(4, max_tokens=16, ignore_eos=True, first_token=400)
    s.add_request(first)
    s.add_request(second)
    resumed_hits = []
    while s.has_unfinished_requests:
        out, _ = step(s)
        for new in out.new_requests:
            if new.request_id == second.request_id and second.num_preemptions:
                resumed_hits.append(new.num_computed_tokens)
        for r in (first, second):
            assert r.num_cached_tokens <= r.num_prompt_tokens
    assert second.num_preemptions >= 1
    assert max(resumed_hits) > second.num_prompt_tokens  # it did resume from its own output blocks
    assert second.num_cached_tokens == 0  # nothing of its prompt was cached when it was first admitted
    assert first.num_cached_tokens == 0


def test_prefix_cache_counters_count_each_prompt_once_through_preemptions():
    """Two requests that do not fit together: the later one is preempted and resumed, its own blocks then hits.
    The counters count each request's prompt at its first admission only (vLLM's prefix-cache stats), so the same
    requests count the same with or without a tight pool."""

    def counters(num_blocks):
        s = make_scheduler(num_blocks=num_blocks, block_size=4)
        for first in (10, 50):
            s.add_request(make_request(list(range(first, first + 8)), max_tokens=20, ignore_eos=True))
        run_until_done(s)
        stats = s.stats()
        return stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits

    roomy, tight = counters(64), counters(10)
    assert roomy == (0, 16, 0)
    assert tight[0] > 0 and tight[1:] == roomy[1:]


def test_a_prefill_only_request_finishes_when_its_prompt_is_computed():
    """A pooling request (embeddings) is chunked like any prompt and ends, stopped and with no token, in the step
    that computes its last prompt token; its blocks are freed then and stay in the prefix cache for the next."""
    s = make_scheduler(max_num_batched_tokens=16)
    pooled = make_request(40, max_tokens=0, prefill_only=True)
    decoding = make_request(6, max_tokens=5)
    s.add_request(pooled)
    s.add_request(decoding)
    ends = {}
    for _ in range(20):
        if not s.has_unfinished_requests:
            break
        _, results = step(s)
        for result in results:
            if result.status.is_finished:
                ends[result.request_id] = result
    assert ends[pooled.request_id].status is RequestStatus.FINISHED_STOPPED
    assert ends[pooled.request_id].new_token_ids == [] and pooled.output_token_ids == []
    assert len(decoding.output_token_ids) == 5
    assert s.kv_cache_manager.usage == 0
    again = make_request(40, max_tokens=0, prefill_only=True)
    s.add_request(again)
    out, _ = step(s)
    assert out.num_scheduled_tokens[again.request_id] == 40 - 36  # cached up to the last full block before its end
    run_until_done(s)


def test_a_prefill_only_request_may_fill_the_context_and_samples_nothing():
    s = make_scheduler(max_model_len=32, num_blocks=8)
    s.check_request(make_request(32, max_tokens=0, prefill_only=True))  # 8 blocks of 4: the whole pool
    with pytest.raises(ContextLengthExceededError, match="33 prompt tokens exceed max_model_len 32"):
        s.check_request(make_request(33, max_tokens=0, prefill_only=True))
    with pytest.raises(ValueError, match="samples nothing"):
        make_request(8, max_tokens=1, prefill_only=True)
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        make_request(8, max_tokens=0)
