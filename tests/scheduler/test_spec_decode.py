"""Speculative decoding in the scheduler: drafts in the step message, their slots, the budget, the rollback.

Driven by `RecordingRunner`, which writes the drafts' K/V as a runner would (positions past the sequence) and
accepts a random number of them: every read must still find exactly the reader's own tokens, and no block in the
prefix-cache index may hold the K/V of a draft that was rejected.
"""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import RequestRejectedError, StepCost

from tests.scheduler.factories import check_invariants, check_step_output, make_request, make_scheduler
from tests.scheduler.recording_runner import RecordingRunner

STOP_ID = 3


class ListProposer:
    """Proposes from a seeded stream of few distinct tokens (so drafts match the sequence now and then)."""

    def __init__(self, k: int, rng: random.Random, tokens=(10, 11)):
        self.num_speculative_tokens = k
        self.rng = rng
        self.tokens = tokens
        self.calls = []

    def propose(self, token_ids, max_num_tokens):
        self.calls.append((len(token_ids), max_num_tokens))
        return [self.rng.choice(self.tokens) for _ in range(self.rng.randint(0, max_num_tokens))]

    def on_request_finished(self, output_token_ids):
        self.finished = getattr(self, "finished", 0) + 1


class FixedProposer:
    def __init__(self, k: int, token: int = 10):
        self.num_speculative_tokens = k
        self.token = token

    def propose(self, token_ids, max_num_tokens):
        return [self.token] * max_num_tokens

    def on_request_finished(self, output_token_ids):
        pass


def make_spec_scheduler(proposer, **kwargs):
    return make_scheduler(proposer=proposer, **kwargs)


def check_no_hashed_block_holds_a_rejected_token(scheduler, runner):
    """Every indexed block's slots hold the K/V of exactly its hashed tokens (never a draft's that was
    rejected: the runner's ledger holds what each slot was last written for)."""
    kv = scheduler.kv_cache_manager
    for block in kv.block_pool.all_blocks():
        if block.block_hash is None:
            continue
        for offset, token_id in enumerate(block.block_hash.token_ids):
            written = runner.slots.get(block.block_id * kv.block_size + offset)
            assert written is not None, f"indexed block {block.block_id} holds an unwritten slot"
            assert written[0][-(offset + 1) :] == block.block_hash.token_ids[: offset + 1], (
                f"indexed block {block.block_id} slot {offset} holds K/V of other tokens"
            )


def one_step(scheduler, runner):
    output = scheduler.schedule()
    check_step_output(scheduler, output)
    scheduler.update_from_output(output, runner.execute(output))
    check_invariants(scheduler)
    check_no_hashed_block_holds_a_rejected_token(scheduler, runner)
    return output


def drive(scheduler, runner, max_steps=5_000):
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests:
            return
        one_step(scheduler, runner)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


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
    )


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.sampled_from([10, 11]), min_size=1, max_size=20),
            st.integers(1, 30),
            st.integers(-2, 2),
            st.sampled_from([None, None, 0, 1, 2]),
        ),
        # a prompt extending a live request's tokens so far (a prefix hit on its blocks, if written)
        st.tuples(st.just("extend"), st.integers(0, 50), st.integers(0, 3), st.integers(1, 6), st.integers(-3, 2)),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
    ),
    max_size=50,
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), ops=operations, k=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_random_workloads_with_random_acceptance_keep_every_invariant(setup, ops, k, seed):
    """Both policies, preemption, chunked prefill, prefix hits, aborts, stop-string finishes, per-request k."""
    rng = random.Random(seed)
    s = make_spec_scheduler(ListProposer(k, rng), **setup)
    vocab = [10] * 7 + [11] * 8 + [STOP_ID]
    runner = RecordingRunner(
        setup["block_size"],
        lambda request_id, token_ids: rng.choice(vocab),
        lambda request_id, drafts: rng.randint(0, len(drafts)),
    )
    added = []
    for op in ops:
        kind = op[0]
        if kind in ("add", "extend"):
            per_request_k = None
            if kind == "add":
                _, prompt, max_tokens, priority, per_request_k = op
            else:
                _, index, extra, max_tokens, priority = op
                live = list(s.requests.values())
                if not live:
                    continue
                prompt = live[index % len(live)].all_token_ids + [10] * extra
            request = make_request(prompt, max_tokens=max_tokens, priority=priority, stop_token_ids=[STOP_ID])
            request.num_speculative_tokens = per_request_k
            try:
                s.add_request(request)
            except RequestRejectedError:
                continue
            added.append(request)
        elif kind == "step":
            for _ in range(op[1]):
                output = one_step(s, runner)
                for request_id, drafts in output.scheduled_spec_decode_tokens.items():
                    request = next(r for r in added if r.request_id == request_id)
                    assert request.num_speculative_tokens is None or len(drafts) <= request.num_speculative_tokens
        elif added:
            ended_id = added[op[1] % len(added)].request_id
            if kind == "abort":
                s.abort([ended_id])
            else:
                s.finish(ended_id, stop_reason="stop-string")
    drive(s, runner)
    assert all(r.is_finished for r in added)
    for r in added:
        assert r.num_output_tokens <= r.max_tokens
    assert s.kv_cache_manager.usage == 0
    stats = s.stats().speculation
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens


def test_drafts_take_only_the_budget_left_after_one_token_per_decode():
    s = make_spec_scheduler(FixedProposer(4), max_num_batched_tokens=12, max_num_seqs=4, num_blocks=64)
    runner = RecordingRunner(4, accept_fn=lambda request_id, drafts: 0)
    for i in range(3):
        s.add_request(make_request(4, max_tokens=20, ignore_eos=True, first_token=100 + 10 * i))
    one_step(s, runner)  # three prompts of 4
    output = one_step(s, runner)
    assert output.total_num_scheduled_tokens == 12
    assert [len(d) for d in output.scheduled_spec_decode_tokens.values()] == [4, 4, 1]  # 12 - one per decode


def test_drafts_stop_one_short_of_max_tokens_and_follow_the_request_cap():
    s = make_spec_scheduler(FixedProposer(4))
    runner = RecordingRunner(4)  # accepts every draft
    short = make_request(4, request_id="short", max_tokens=3, ignore_eos=True)
    capped = make_request(4, request_id="capped", max_tokens=20, ignore_eos=True, first_token=200)
    off = make_request(4, request_id="off", max_tokens=20, ignore_eos=True, first_token=300)
    capped.num_speculative_tokens, off.num_speculative_tokens = 2, 0
    for r in (short, capped, off):
        s.add_request(r)
    one_step(s, runner)  # prompts; one token each
    output = one_step(s, runner)
    assert output.scheduled_spec_decode_tokens["short"] == (10,)  # 2 more tokens allowed: one draft + one
    assert output.scheduled_spec_decode_tokens["capped"] == (10, 10)
    assert "off" not in output.scheduled_spec_decode_tokens
    assert short.is_finished and short.num_output_tokens == 3
    assert capped.num_output_tokens == 1 + 3 and capped.num_computed_tokens == capped.num_tokens - 1
    drive(s, runner)
    assert s.kv_cache_manager.usage == 0


def test_rejected_drafts_roll_back_and_their_block_is_never_a_hit():
    """Drafts fill a block; all are rejected. The block must not be indexed, and a request whose prompt
    is the sequence with the drafts must compute it rather than hit it."""
    s = make_spec_scheduler(FixedProposer(3, token=50), block_size=4)
    runner = RecordingRunner(4, token_fn=lambda request_id, token_ids: 60, accept_fn=lambda request_id, drafts: 0)
    r = make_request([10, 11, 12], request_id="r", max_tokens=10, ignore_eos=True)
    s.add_request(r)
    one_step(s, runner)  # prompt; samples 60 -> [10, 11, 12, 60]
    output = one_step(s, runner)  # computes 60 at position 3 and drafts 50, 50, 50 at 4..6
    assert output.scheduled_spec_decode_tokens["r"] == (50, 50, 50)
    assert output.num_scheduled_tokens["r"] == 4
    assert r.all_token_ids == [10, 11, 12, 60, 60] and r.num_computed_tokens == 4
    s.proposer = None  # no more drafts: the second block fills with accepted tokens only
    s.abort(["r"])
    probe = make_request([10, 11, 12, 60, 50, 50, 50, 50, 7], request_id="probe", max_tokens=1, ignore_eos=True)
    s.add_request(probe)
    one_step(s, runner)
    assert probe.num_cached_tokens == 4  # the first block (accepted tokens) only
    drive(s, runner)
    assert s.kv_cache_manager.usage == 0


def test_acceptance_is_counted_per_position():
    s = make_spec_scheduler(FixedProposer(3))
    accept = iter([3, 1, 0, 2])
    runner = RecordingRunner(4, accept_fn=lambda request_id, drafts: min(next(accept, 0), len(drafts)))
    s.add_request(make_request(4, max_tokens=40, ignore_eos=True))
    for _ in range(5):
        one_step(s, runner)
    stats = s.stats().speculation
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 12, 6)
    assert stats.num_accepted_tokens_per_pos == [3, 2, 1]
    assert stats.mean_acceptance_length == 1 + 6 / 4


def test_a_draft_never_preempts_another_request():
    """Drafts that would need a block the pool lacks are dropped; the decode goes on without them."""
    s = make_spec_scheduler(FixedProposer(4), num_blocks=2, block_size=4, max_model_len=64)
    runner = RecordingRunner(4, accept_fn=lambda request_id, drafts: 0)
    a = make_request(3, request_id="a", max_tokens=4, ignore_eos=True)
    b = make_request(3, request_id="b", max_tokens=4, ignore_eos=True, first_token=200)
    s.add_request(a)
    s.add_request(b)
    one_step(s, runner)
    output = one_step(s, runner)  # each holds one block of 4; drafts would need a second block each
    assert not output.scheduled_spec_decode_tokens and not output.preempted_request_ids
    drive(s, runner)
    assert s.kv_cache_manager.usage == 0 and s.num_preemptions >= 0


def test_drafts_take_only_blocks_no_decode_needs():
    """Every decode's own token is placed before any draft: a's drafts would need the pool's last block, which
    b's next token needs; b decodes, a decodes without drafts, nobody is preempted."""
    s = make_spec_scheduler(FixedProposer(4), num_blocks=4, block_size=4, max_model_len=64)
    runner = RecordingRunner(4, accept_fn=lambda request_id, drafts: 0)
    a = make_request(3, request_id="a", max_tokens=12, ignore_eos=True)  # decodes at position 3: its own block
    b = make_request(4, request_id="b", max_tokens=12, ignore_eos=True, first_token=200)  # needs a new block
    c = make_request(3, request_id="c", max_tokens=12, ignore_eos=True, first_token=300)
    for request in (a, b, c):
        s.add_request(request)
    one_step(s, runner)  # the prompts: one block each, one left
    output = one_step(s, runner)
    assert not output.preempted_request_ids
    assert output.num_scheduled_tokens["b"] == 1 and "a" not in output.scheduled_spec_decode_tokens
    drive(s, runner)
    assert s.kv_cache_manager.usage == 0


def test_tight_pools_with_drafts_preemption_and_aborts_between_schedule_and_update():
    """Seeded fuzzing where decodes with drafts run pools dry (counted: the test fails unless requests
    verifying drafts are preempted, drafts are partly accepted and prefix hits happen)."""
    seen = {"preempted_with_drafts": 0, "partly_accepted": 0, "hits": 0}
    for seed in range(150):
        rng = random.Random(seed)
        block_size = rng.choice([1, 2, 4])
        s = make_spec_scheduler(
            ListProposer(rng.randint(1, 5), rng),
            num_blocks=rng.randint(4, 12),
            block_size=block_size,
            max_num_seqs=rng.randint(2, 4),
            max_num_batched_tokens=rng.randint(4, 16),
            max_model_len=64,
            policy=rng.choice(["fcfs", "priority"]),
            adaptive_drafts=rng.random() < 0.5,
            max_drafting_batch=rng.choice([None, None, 1, 2]),
        )

        def accept(request_id, drafts):
            accepted = rng.randint(0, len(drafts))
            seen["partly_accepted"] += 0 < accepted < len(drafts)
            return accepted

        runner = RecordingRunner(block_size, lambda request_id, token_ids: rng.choice([10, 11]), accept)
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
            drafting = {r.request_id for r in s.running if r.num_tokens - r.num_computed_tokens == 1}
            output = s.schedule()
            check_step_output(s, output)
            seen["preempted_with_drafts"] += bool(
                output.scheduled_spec_decode_tokens and output.preempted_request_ids and drafting
            )
            if s.requests and rng.random() < 0.1:
                s.abort([rng.choice(list(s.requests))])
            s.update_from_output(output, runner.execute(output))
            check_invariants(s)
            check_no_hashed_block_holds_a_rejected_token(s, runner)
        drive(s, runner)
        seen["hits"] += s.stats().prefix_cache_hits
        assert s.kv_cache_manager.usage == 0
    assert all(seen.values()), seen


def test_adaptive_drafts_follow_each_requests_recent_acceptance():
    """k falls to 1 while a request's drafts are rejected, and climbs back to the proposer's k as they are
    accepted again (half weight to the latest verification)."""
    s = make_scheduler(proposer=FixedProposer(5), adaptive_drafts=True, num_blocks=64, max_model_len=256)
    accept_all = [False]
    runner = RecordingRunner(4, accept_fn=lambda request_id, drafts: len(drafts) if accept_all[0] else 0)
    s.add_request(make_request(4, max_tokens=100, ignore_eos=True))
    one_step(s, runner)
    sizes = []
    for step in range(12):
        accept_all[0] = step >= 5
        output = one_step(s, runner)
        sizes.append(len(next(iter(output.scheduled_spec_decode_tokens.values()))))
    # k = 1 + round(4 * average acceptance), the average from 1: halved by each rejection, halfway up by each
    # full acceptance
    assert sizes == [5, 3, 2, 2, 1, 1, 3, 4, 5, 5, 5, 5]


def test_no_drafts_in_a_batch_larger_than_max_drafting_batch():
    s = make_scheduler(proposer=FixedProposer(2), max_drafting_batch=2, num_blocks=64)
    runner = RecordingRunner(4)
    for i in range(3):
        s.add_request(make_request(4, request_id=f"r{i}", max_tokens=6, ignore_eos=True, first_token=100 + 10 * i))
    one_step(s, runner)
    assert not one_step(s, runner).scheduled_spec_decode_tokens  # three decode: speculation paused
    s.abort(["r2"])
    assert one_step(s, runner).scheduled_spec_decode_tokens  # two: drafts again


def test_the_step_cost_model_keeps_only_drafts_that_raise_tokens_per_second():
    """Rows nearly free up to 8, then dearer: one stream drafts; 16 streams whose drafts
    were rejected lately do not; 16 that copy well still do, as far as their rows pay."""
    cost = StepCost((1, 2, 4, 8, 16, 32, 64), (10.0, 10.1, 10.2, 10.5, 12.0, 18.0, 60.0))

    def drafted(num_requests, acceptance):
        s = make_scheduler(
            proposer=FixedProposer(4),
            step_cost=cost,
            num_blocks=256,
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=256,
        )
        runner = RecordingRunner(4)
        for i in range(num_requests):
            s.add_request(make_request(4, max_tokens=50, ignore_eos=True, first_token=100 + 10 * i))
        one_step(s, runner)
        for request in s.running:
            request.draft_acceptance = acceptance
        return one_step(s, runner).scheduled_spec_decode_tokens

    assert [len(d) for d in drafted(1, 0.2).values()] == [4]
    assert drafted(16, 0.2) == {}
    some = drafted(16, 0.9)
    assert 0 < len(some) < 16 and all(len(d) == 4 for d in some.values())


class BatchListProposer(ListProposer):
    """A `BatchDraftProposer` (as a draft model is): asked once per step for every decoding request; keeps a
    state per request it drafted for until told to release it."""

    def __init__(self, k, rng, scheduler_ref):
        super().__init__(k, rng)
        self.live: set[str] = set()
        self.scheduler_ref = scheduler_ref
        self.batches = 0

    def propose_batch(self, queries):
        scheduler = self.scheduler_ref[0]
        budget = scheduler.scheduler_config.max_num_batched_tokens
        decoding = [r for r in scheduler.running if r.num_tokens - r.num_computed_tokens <= 1]
        assert sum(q.max_num_tokens for q in queries) <= budget - len(decoding)
        for query in queries:
            request = scheduler.requests[query.request_id]
            assert request in decoding and list(query.token_ids) == request.all_token_ids
            assert 0 < query.max_num_tokens <= self.num_speculative_tokens
        self.batches += 1
        self.live |= {q.request_id for q in queries}
        return [self.propose(q.token_ids, q.max_num_tokens) for q in queries]

    def release(self, request_id):
        self.live.discard(request_id)


def test_a_batched_proposer_is_asked_once_per_step_and_told_of_every_end_and_preemption():
    released_running = batches = 0
    for seed in range(60):
        rng = random.Random(seed)
        ref = []
        proposer = BatchListProposer(rng.randint(1, 4), rng, ref)
        s = make_spec_scheduler(
            proposer,
            num_blocks=rng.randint(4, 10),
            block_size=rng.choice([1, 2, 4]),
            max_num_seqs=rng.randint(2, 4),
            max_num_batched_tokens=rng.randint(4, 12),
            max_model_len=64,
        )
        ref.append(s)
        runner = RecordingRunner(s.block_size, lambda request_id, token_ids: rng.choice([10, 11]))
        for i in range(8):
            request = make_request(
                rng.randint(1, 10), request_id=f"r{i}", max_tokens=rng.randint(1, 20), ignore_eos=True
            )
            try:
                s.add_request(request)
            except RequestRejectedError:
                pass  # larger than the whole pool
        steps = 0
        while s.has_unfinished_requests:
            output = s.schedule()
            steps += 1
            if s.requests and rng.random() < 0.05:
                s.abort([rng.choice(list(s.requests))])
            s.update_from_output(output, runner.execute(output))
            check_invariants(s)
            # every state it holds is a running request's (preempted, finished and aborted ones were released)
            assert proposer.live <= {r.request_id for r in s.running}
            released_running += s.num_preemptions
        assert proposer.batches <= steps and proposer.live == set()
        batches += proposer.batches
        assert s.kv_cache_manager.usage == 0
    assert released_running > 0 and batches > 0  # preemptions happened, drafts were asked for


class FixedBatchProposer(FixedProposer):
    def __init__(self, k):
        super().__init__(k)
        self.asked = []

    def propose_batch(self, queries):
        self.asked.append(len(queries))
        return [[self.token] * q.max_num_tokens for q in queries]

    def release(self, request_id):
        pass


def test_a_draft_models_forwards_are_weighed_before_it_is_asked():
    """The target's rows as in the test above; a draft forward costs 3 (nearly flat in its rows). One stream
    that copies well drafts; 16 do not (80 verification rows would cost more than their tokens, before the
    draft's 4 forwards), and the draft model is not even asked."""
    cost = StepCost((1, 2, 4, 8, 16, 32, 64), (10.0, 10.1, 10.2, 10.5, 12.0, 18.0, 60.0))
    draft_cost = StepCost((1, 16), (3.0, 3.5))

    def drafted(num_requests, acceptance):
        proposer = FixedBatchProposer(4)
        s = make_scheduler(
            proposer=proposer,
            step_cost=cost,
            draft_cost=draft_cost,
            num_blocks=256,
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=256,
        )
        runner = RecordingRunner(4)
        for i in range(num_requests):
            s.add_request(make_request(4, max_tokens=50, ignore_eos=True, first_token=100 + 10 * i))
        one_step(s, runner)
        for request in s.running:
            request.draft_acceptance = acceptance
        return one_step(s, runner).scheduled_spec_decode_tokens, proposer.asked

    tokens, asked = drafted(1, 0.95)  # 4.5 tokens expected for 22 ms, against 1 for 10
    assert [len(d) for d in tokens.values()] == [4] and asked == [1]
    assert drafted(1, 0.2)[0] == {}  # 0.25 tokens expected from 4 rows and 12 ms of draft forwards
    assert drafted(16, 0.95) == ({}, [])
