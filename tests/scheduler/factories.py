"""Builders and invariant checks for scheduler tests: no model, no torch, no network."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Callable, Iterable, Optional, Sequence, Union

from scheduler import (
    CacheConfig,
    BatchDraftProposer,
    DraftProposer,
    Request,
    RequestStepOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepCost,
)

EOS = 2


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
    proposer: Optional[Union[DraftProposer, BatchDraftProposer]] = None,
    adaptive_drafts: bool = False,
    max_drafting_batch: Optional[int] = None,
    step_cost: Optional[StepCost] = None,
    kv_group_windows: Sequence[Optional[int]] = (None,),
    draft_cost: Optional[StepCost] = None,
    max_concurrent_batches: int = 1,
    long_prefill_token_threshold: int = 0,
    num_state_snapshots: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=policy,
            max_concurrent_batches=max_concurrent_batches,
            long_prefill_token_threshold=long_prefill_token_threshold,
        ),
        CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            num_state_snapshots=num_state_snapshots,
        ),
        proposer,
        adaptive_drafts=adaptive_drafts,
        max_drafting_batch=max_drafting_batch,
        step_cost=step_cost,
        kv_group_windows=kv_group_windows,
        draft_cost=draft_cost,
    )


_ids = itertools.count()


def make_request(
    prompt: Sequence[int] | int = 8,
    *,
    request_id: Optional[str] = None,
    max_tokens: int = 4,
    min_tokens: int = 0,
    eos_token_ids: Iterable[int] = (EOS,),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    priority: int = 0,
    arrival_time: Optional[float] = None,
    first_token: int = 100,
    prefill_only: bool = False,
) -> Request:
    """A request; an int prompt means that many distinct tokens starting at `first_token`."""
    prompt_ids = list(range(first_token, first_token + prompt)) if isinstance(prompt, int) else list(prompt)
    kwargs = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Request(
        request_id=request_id if request_id is not None else f"req-{next(_ids)}",
        prompt_token_ids=prompt_ids,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        eos_token_ids=frozenset(eos_token_ids),
        stop_token_ids=frozenset(stop_token_ids),
        ignore_eos=ignore_eos,
        priority=priority,
        prefill_only=prefill_only,
        **kwargs,
    )


def sample_for(
    scheduler: Scheduler,
    output: SchedulerOutput,
    token_fn: Callable[[Request], int] = lambda r: 7,
) -> dict[str, list[int]]:
    """What a model runner returns: one token per request whose step reaches its sequence end."""
    sampled = {}
    for request_id, num_tokens in output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        if output.num_computed_tokens[request_id] + num_tokens == request.num_tokens:
            sampled[request_id] = [token_fn(request)]
    return sampled


def step(
    scheduler: Scheduler,
    token_fn: Callable[[Request], int] = lambda r: 7,
) -> tuple[SchedulerOutput, list[RequestStepOutput]]:
    """One schedule + update round with the invariants checked after each half."""
    output = scheduler.schedule()
    check_step_output(scheduler, output)
    check_invariants(scheduler)
    results = scheduler.update_from_output(output, sample_for(scheduler, output, token_fn))
    check_invariants(scheduler)
    return output, results


def run_until_done(
    scheduler: Scheduler,
    max_steps: int = 10_000,
    token_fn: Callable[[Request], int] = lambda r: 7,
) -> list[SchedulerOutput]:
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests:
            return outputs
        outputs.append(step(scheduler, token_fn)[0])
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def check_step_output(scheduler: Scheduler, output: SchedulerOutput) -> None:
    config = scheduler.scheduler_config
    assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(output.num_scheduled_tokens) <= config.max_num_seqs
    assert all(n >= 1 for n in output.num_scheduled_tokens.values())
    assert set(output.num_computed_tokens) == set(output.num_scheduled_tokens)
    for request_id, drafts in output.scheduled_spec_decode_tokens.items():
        request = scheduler.requests[request_id]
        assert drafts and output.num_scheduled_tokens[request_id] == 1 + len(drafts)
        assert output.num_computed_tokens[request_id] + 1 == request.num_tokens  # drafts follow a decode only
        assert request.num_tokens + len(drafts) < request.max_num_tokens  # and never past max_tokens
    for request_id, num_tokens in output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        start = output.num_computed_tokens[request_id]
        assert start == request.num_computed_tokens
        assert start + num_tokens <= request.num_tokens + len(output.scheduled_spec_decode_tokens.get(request_id, ()))
        groups = scheduler.kv_cache_manager.get_blocks(request_id)
        assert all(len(blocks) * scheduler.block_size >= start + num_tokens for blocks in groups)
    for new in output.new_requests:
        assert new.block_ids == scheduler.kv_cache_manager.get_block_ids(new.request_id)
        assert list(new.token_ids) == scheduler.requests[new.request_id].all_token_ids


def check_invariants(scheduler: Scheduler) -> None:
    """Block accounting: every block is free xor referenced, ref counts equal table
    membership, hashed blocks hold exactly their tokens."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    free_ids = pool.free_block_ids()
    assert len(free_ids) == len(set(free_ids))
    owners: Counter[int] = Counter()
    for request_id in scheduler.requests:
        groups = kv.get_blocks(request_id)
        ids = [b.block_id for blocks in groups for b in blocks if b is not kv.null_block]
        assert len(ids) == len(set(ids)), "a request holds the same block twice"
        owners.update(ids)
        request = scheduler.requests[request_id]
        for group, (blocks, window) in enumerate(zip(groups, kv.group_windows)):
            for index, block in enumerate(blocks):
                if block is kv.null_block:  # a sliding group's, behind its window
                    assert window is not None and (index + 1) * kv.block_size <= request.num_computed_tokens
                    continue
                if block.block_hash is not None:
                    tokens = request.all_token_ids[index * kv.block_size : (index + 1) * kv.block_size]
                    assert list(block.block_hash.token_ids) == tokens
        if request.is_finished or request.status.name in ("WAITING", "PREEMPTED"):
            assert not groups, f"{request.status.name} request holds blocks"
    all_blocks = pool.all_blocks()
    assert [b.block_id for b in all_blocks] == list(range(pool.num_blocks))
    free = set(free_ids)
    for block in all_blocks:
        assert block.ref_cnt == owners.get(block.block_id, 0)
        assert (block.ref_cnt == 0) == (block.block_id in free)
    assert len(free_ids) + sum(1 for b in all_blocks if b.ref_cnt > 0) == pool.num_blocks
    running = {r.request_id for r in scheduler.running}
    waiting = {r.request_id for r in scheduler.waiting}
    assert not running & waiting
    assert running | waiting == set(scheduler.requests)
    assert len(scheduler.running) <= scheduler.scheduler_config.max_num_seqs
    check_steps_in_flight(scheduler)


def check_steps_in_flight(scheduler: Scheduler) -> None:
    """Steps awaiting their update: at most N, each request in one of them at most, none of those preempted
    or behind what its step computes; every pending block held by a live request, unindexed, and filled by
    a step in flight or the latest one."""
    outstanding = list(scheduler._outstanding)
    assert len(outstanding) == scheduler.num_outstanding_steps <= scheduler.max_concurrent_batches
    assert [o.step_id for o in outstanding] == sorted({o.step_id for o in outstanding})
    scheduled = [request_id for o in outstanding for request_id in o.num_scheduled_tokens]
    assert len(scheduled) == len(set(scheduled)), "a request is in two steps in flight"
    if scheduler.max_concurrent_batches > 1:
        assert scheduler._in_flight == set(scheduled)
    for o in outstanding:
        for request_id, start in o.num_computed_tokens.items():
            request = scheduler.requests.get(request_id)
            if request is not None and request.status.name == "RUNNING":
                assert request.num_computed_tokens == start, f"{request_id} advanced before its step's update"
            elif request is not None:  # a new request reusing the id of one that ended in flight
                assert request.status.name == "WAITING" and not request.num_preemptions
    kv = scheduler.kv_cache_manager
    steps = {o.step_id for o in outstanding} | {scheduler.num_steps}
    for block_id, step_id in kv._pending_step.items():
        assert step_id in steps, f"block {block_id} pending for step {step_id}, which is not in flight"
        block, block_hash = kv._pending[step_id][block_id]
        assert block.block_id == block_id and block.ref_cnt > 0 and block.block_hash is None
        assert kv._pending_hashes[block_hash.value] == block_id
    assert len(kv._pending_hashes) == kv.num_pending_blocks
