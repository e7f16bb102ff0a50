"""Continuous batching: which requests compute how many tokens in each step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence, Union

from scheduler.bidirectional_spans import chunk_length, longest_span
from scheduler.config import CacheConfig, SchedulerConfig
from scheduler.draft_proposer import (
    BatchDraftProposer,
    DraftProposer,
    DraftQuery,
    FeatureDraftProposer,
    SpecDecodeStats,
)
from scheduler.errors import (
    ContextLengthExceededError,
    DuplicateRequestIdError,
    EmptyPromptError,
    KVCacheTooSmallError,
    MediaSpanTooLongError,
)
from scheduler.kv_cache_manager import BlockIds, KVCacheManager
from scheduler.kv_tiers import KVTiers
from scheduler.state_snapshots import SnapshotOps
from scheduler.output import NewRequestData, RequestStepOutput, SchedulerOutput, SchedulerStats, token_array
from scheduler.request import Request, RequestStatus
from scheduler.request_queue import make_request_queue
from scheduler.step_cost import StepCost

_RUNNING = RequestStatus.RUNNING
AnyDraftProposer = Union[DraftProposer, BatchDraftProposer]
DRAFT_RETRY_DRIFT = 0.125
"""Share of the way back to 1 a request's acceptance estimate moves in a step whose drafts did not pay."""


@dataclass(slots=True)
class _StepPlan:
    """The step being assembled by `Scheduler.schedule`."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    num_computed: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, BlockIds] = field(default_factory=dict)
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    spec_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)  # drafts to verify, by request
    waits_for_blocks: bool = False  # a running request found no blocks and no victim outside the steps in flight
    waits_for_room: bool = False  # a running prompt's next span (computed whole) does not fit what is left of the step

    def add(self, request: Request, num_tokens: int, new_block_ids: Optional[BlockIds] = None) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.num_computed[request.request_id] = request.num_computed_tokens
        if new_block_ids is not None and any(new_block_ids):
            self.new_block_ids[request.request_id] = new_block_ids
        self.budget -= num_tokens

    def extend(self, request: Request, drafts: tuple[int, ...], new_block_ids: BlockIds) -> None:
        """A scheduled decode also verifies `drafts` (their lookahead blocks: `new_block_ids`)."""
        request_id = request.request_id
        self.num_scheduled[request_id] += len(drafts)
        if any(new_block_ids):
            earlier = self.new_block_ids.get(request_id)
            if earlier is not None:
                new_block_ids = tuple(a + b for a, b in zip(earlier, new_block_ids))
            self.new_block_ids[request_id] = new_block_ids
        self.spec_tokens[request_id] = drafts
        self.budget -= len(drafts)

    def drop(self, request_id: str) -> None:
        """Undo `add` for a request preempted later in the same step."""
        num_tokens = self.num_scheduled.pop(request_id, 0)
        self.num_computed.pop(request_id, None)
        self.new_block_ids.pop(request_id, None)
        self.spec_tokens.pop(request_id, None)
        self.budget += num_tokens


class Scheduler:
    """Continuous batching over a paged KV cache, without prefill/decode phases.

    Each step spends `max_num_batched_tokens` over at most `max_num_seqs`
    requests: first one token for every running request that is decoding, then
    chunks of running prompts, then newly admitted requests (FCFS or by
    priority), whose prompts may be split across steps (chunked prefill). When
    blocks run out, the most recently admitted running request (under the
    priority policy: the lowest-priority one) is preempted: its blocks are freed
    and it goes back to the head of the queue, to be recomputed later.

    Blocks a step fills become prefix-cache hits only in `update_from_output`, once
    the step has run, so soundness does not depend on which request is preempted or
    in which order requests are scheduled (no invariant about partially prefilled
    requests is needed under either policy). Admission allocates a prompt's whole
    remainder, so a running prefill never needs blocks, and only decodes preempt.

    A request whose media spans attend both ways (`Request.bidirectional_spans`, Gemma 3's images) computes each
    span in one step: its chunks end before a span or after it (a span may pass the chunk cap, never the budget;
    one longer than max_num_batched_tokens is refused at admission), and its prefix-cache hits end outside
    them. While a running prompt's next span does not fit what the step has left, no request is admitted.

    With a `proposer` (speculative decoding) a decoding request also verifies the
    proposer's draft tokens: they take slots beyond the sequence (allocated, never
    hashed), count against the token budget (what is left after one token per
    decode), and never preempt anyone (a request whose drafts do not fit decodes
    without them). `update_from_output` rolls `num_computed_tokens` back past the
    rejected ones. A `BatchDraftProposer` (a draft model) is asked once per step for
    all decoding requests, and told when a request's state may go (ended, preempted).

    Several steps in flight (`max_concurrent_batches` N > 1, pipeline parallelism): `schedule` may be
    called again while up to N - 1 earlier non-empty steps await `update_from_output`, which takes
    them oldest first. A request of a step in flight is in no other step until that one is updated
    (its next token or chunk depends on it), and is never preempted: a request that needs blocks
    preempts only requests outside the steps in flight, and when the policy's choice among those is
    itself, it waits instead (keeping its blocks; those steps may end requests, and the policy decides
    again once they are updated). With nothing in flight nobody waits and preemption is as with N = 1, so
    the engine always makes progress by updating its oldest step. Each step takes at most an N-th of the
    running and admissible requests (`_fair_share`), so that the N steps in flight share the work. A
    request ended while its step is in flight frees its blocks at once: the stages run steps in order, so
    a later step writing a reused block writes after the earlier one is done with it.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        proposer: Optional[AnyDraftProposer] = None,
        *,
        adaptive_drafts: bool = False,
        max_drafting_batch: Optional[int] = None,
        step_cost: Optional[StepCost] = None,
        kv_group_windows: Sequence[Optional[int]] = (None,),
        draft_cost: Optional[StepCost] = None,
        max_loras: Optional[int] = None,
        kv_tiers: Optional[KVTiers] = None,
        kv_group_chunks: Sequence[Optional[int]] = (),
    ):
        """`adaptive_drafts`: each request's k follows the share of its recent drafts accepted (1 when none are,
        the proposer's k when all are); `max_drafting_batch`: no drafts in a step with more decodes than this;
        `step_cost`: a step's measured time by its rows, against which each request's drafts must pay
        (`_drafts_that_pay`); `draft_cost`: one forward of a batched proposer's draft model by its rows, k of
        which a step with drafts adds (the requests to draft for are then chosen before proposing);
        `kv_group_windows`: the sliding window of each of the KV cache's layer groups (None: full attention; see
        KVCacheManager); `kv_group_chunks`: each group's attention chunk (None: none; () none at all);
        `max_loras`: distinct LoRA adapters across running requests at most (a request
        whose adapters would exceed it waits, and those behind it that fit go first; base requests never count);
        `kv_tiers`: host-memory and disk tiers (KVCacheManager: blocks beyond the pool, restored, not computed)."""
        if cache_config.num_blocks is None:
            raise ValueError("cache_config.num_blocks must be resolved before building a Scheduler")
        if scheduler_config.max_model_len is None:
            raise ValueError("scheduler_config.max_model_len must be resolved before building a Scheduler")
        if proposer is not None and cache_config.num_state_snapshots:
            raise ValueError("draft tokens cannot be taken back out of a recurrent state: no proposer with snapshots")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len: int = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            kv_group_windows,
            kv_tiers,
            kv_group_chunks,
            cache_config.num_state_snapshots,
        )
        self.waiting = make_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_steps = 0  # steps scheduled
        self._finished_since_last_step: set[str] = set()
        self._recomputed_since_last_step: set[str] = set()  # `recompute`'s, told the runner as preempted
        self.max_concurrent_batches = scheduler_config.max_concurrent_batches
        self._outstanding: deque[SchedulerOutput] = deque()  # non-empty steps awaiting their update, oldest first
        self._in_flight: set[str] = set()  # ids of the requests they schedule (kept only when N > 1)
        self.proposer = proposer
        # an EAGLE proposer: fed the target's features of each step (update_from_output)
        self._feature_proposer = proposer if isinstance(proposer, FeatureDraftProposer) else None
        self.adaptive_drafts = adaptive_drafts
        self.max_drafting_batch = max_drafting_batch
        self.step_cost = step_cost
        self.draft_cost = draft_cost
        self.spec_decode_stats: Optional[SpecDecodeStats] = None if proposer is None else SpecDecodeStats()
        self.max_loras = max_loras

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestRejectedError if it can never be served."""
        if request.request_id in self.requests:
            raise DuplicateRequestIdError(request.request_id)
        self.check_request(request)
        request.max_num_tokens = request.num_prompt_tokens + request.max_tokens  # <= max_model_len (checked)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """End the given requests in whatever state they are; returns those it ended."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def finish(
        self,
        request_id: str,
        status: RequestStatus = RequestStatus.FINISHED_STOPPED,
        stop_reason: Union[int, str, None] = None,
    ) -> Optional[Request]:
        """End a request for a reason found outside the scheduler (a stop string)."""
        if not status.is_finished:
            raise ValueError(f"{status!r} is not a finished state")
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.stop_reason = stop_reason
        self._finish(request, status)
        return request

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def has_finished_notices(self) -> bool:
        """Requests ended since the last step, which the next step message reports to the runner."""
        return bool(self._finished_since_last_step)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_outstanding_steps(self) -> int:
        """Non-empty steps scheduled and not yet updated (an empty step never is: nothing awaits its update)."""
        return len(self._outstanding)

    def recompute(self, request_ids: Iterable[str]) -> None:
        """Send running requests back to the queue's front to be computed again from their start, as a
        preemption does (the KV they were to be given is lost: a restore that failed); the next step tells the
        runner."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and request.status is _RUNNING:
                self._preempt(request)
                self._recomputed_since_last_step.add(request_id)

    def _take_recomputed(self) -> frozenset[str]:
        recomputed = frozenset(self._recomputed_since_last_step)
        self._recomputed_since_last_step.clear()
        return recomputed

    def abandon_steps(self) -> None:
        """Forget every step awaiting its update (the engine could not run them): the blocks they fill are never
        indexed, and their requests are scheduled again from where their last updated step left them."""
        self._outstanding.clear()
        self._in_flight.clear()
        self.kv_cache_manager.discard_steps()

    def stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            speculation=None if self.spec_decode_stats is None else self.spec_decode_stats.snapshot(),
            kv_tiers=() if self.kv_cache_manager.kv_tiers is None else self.kv_cache_manager.kv_tiers.stats,
        )

    # ------------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        """The next step. Its filled blocks become prefix-cache hits when `update_from_output` reports it done.

        With `max_concurrent_batches` N, up to N - 1 earlier non-empty steps may still await their update
        (RuntimeError beyond that); with N = 1, a step left without its update is abandoned, as the engine
        does after a failed step."""
        max_num_batched_tokens = self.scheduler_config.max_num_batched_tokens
        if len(self._outstanding) >= self.max_concurrent_batches:
            if self.max_concurrent_batches > 1:
                raise RuntimeError(
                    f"{len(self._outstanding)} steps await update_from_output, "
                    f"at most {self.max_concurrent_batches} may be in flight"
                )
            self.abandon_steps()  # a step scheduled before that never completed
        self.num_steps += 1
        self.kv_cache_manager.begin_step(self.num_steps)
        plan = _StepPlan(budget=max_num_batched_tokens)
        in_flight = self._in_flight
        # With steps in flight their requests sit this step out (chosen once: the loops below stay as with N = 1).
        running = [r for r in self.running if r.request_id not in in_flight] if in_flight else list(self.running)
        max_requests = self.scheduler_config.max_num_seqs
        if self.max_concurrent_batches > 1:
            max_requests = self._fair_share()
            del running[max_requests:]
        if self.proposer is None:
            self._schedule_decodes(plan, running)
        else:
            self._schedule_decodes_with_drafts(plan, self.proposer, running)
        # Decodes take one token each (and their drafts) and max_num_batched_tokens >= max_num_seqs.
        plan.budget = max_num_batched_tokens - sum(plan.num_scheduled.values())
        prefilling = [r for r in running if len(r.all_token_ids) - r.num_computed_tokens > 1]
        for request in prefilling:  # then chunks of running prompts
            if plan.budget <= 0:
                break
            if request.status is _RUNNING:
                num_left = request.num_tokens - request.num_computed_tokens
                num_tokens = self._chunk_length(request, request.num_computed_tokens, num_left, plan.budget)
                if num_tokens:
                    self._schedule_running(plan, request, num_tokens)
                else:
                    # No admissions this step: new prompts would become decodes that shrink what later steps
                    # leave for the span, so it could wait forever.
                    plan.waits_for_room = True
        if not plan.preempted and not plan.waits_for_blocks and not plan.waits_for_room:
            self._admit_waiting(plan, max_requests)

        finished = frozenset(self._finished_since_last_step)
        self._finished_since_last_step.clear()
        tier_ops = self.kv_cache_manager.take_tier_ops()
        snapshot_ops = self._snapshot_ops(plan)
        output = SchedulerOutput(
            num_scheduled_tokens=plan.num_scheduled,
            num_computed_tokens=plan.num_computed,
            step_id=self.num_steps,
            new_requests=tuple(plan.new_requests),
            new_block_ids=plan.new_block_ids,
            preempted_request_ids=frozenset(plan.preempted) | self._take_recomputed(),
            finished_request_ids=finished,
            scheduled_spec_decode_tokens=plan.spec_tokens,
            kv_tier_saves=tier_ops.disk_saves,
            kv_tier_restores=tier_ops.disk_restores,
            kv_memory_saves=tier_ops.memory_saves,
            kv_memory_restores=tier_ops.memory_restores,
            state_restores=snapshot_ops.restores,
            state_saves=snapshot_ops.saves,
        )
        if plan.num_scheduled:
            self._outstanding.append(output)
            if self.max_concurrent_batches > 1:
                in_flight.update(plan.num_scheduled)
        return output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: Mapping[str, Sequence[int]],
        draft_features: Optional[Mapping[str, object]] = None,
    ) -> list[RequestStepOutput]:
        """Advance the scheduled requests, append sampled tokens, apply stop rules. `draft_features`: what the
        runner computed for a `FeatureDraftProposer` (EAGLE's hidden states), by request, handed to it.

        Requests that finish are freed here; the outputs list every request that
        got tokens or finished. The blocks the step filled join the prefix-cache index.
        Steps in flight are updated oldest first (ValueError otherwise); an empty step needs no update
        (it returns no outputs).
        """
        outstanding = self._outstanding
        step_id = scheduler_output.step_id
        if not outstanding or outstanding[0].step_id != step_id:
            if scheduler_output.is_empty:
                return []
            raise ValueError(
                f"update for step {step_id}, which is not the oldest in flight "
                f"(in flight: {[o.step_id for o in outstanding]}; steps are updated in the order scheduled, "
                "and with max_concurrent_batches 1 a new step abandons one left without its update)"
            )
        outstanding.popleft()
        self.kv_cache_manager.commit_step(step_id)
        if self._in_flight:
            self._in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        outputs: list[RequestStepOutput] = []
        append_output = outputs.append
        new_output = tuple.__new__  # RequestStepOutput without its Python-level __new__
        any_finished = False
        get_request = self.requests.get
        get_sampled = sampled_token_ids.get
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if draft_features and self._feature_proposer is not None:
            self._observe_features(draft_features)
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = get_request(request_id)
            if request is None or request.status is not _RUNNING:
                continue  # ended between schedule() and now
            num_computed = request.num_computed_tokens + num_tokens
            if spec_tokens and request_id in spec_tokens:
                num_computed -= self._num_rejected(request, spec_tokens[request_id], get_sampled(request_id))
            request.num_computed_tokens = num_computed
            all_token_ids = request.all_token_ids
            if num_computed < len(all_token_ids):
                continue  # a prompt chunk short of the end samples nothing
            if request.prefill_only:  # its prompt computed: done (the runner pooled it)
                request.status = RequestStatus.FINISHED_STOPPED
                self._release(request)
                any_finished = True
                append_output(new_output(RequestStepOutput, (request_id, [], request.status, None)))
                continue
            token_ids = get_sampled(request_id)
            if not token_ids:
                continue
            if len(token_ids) == 1:  # the common case, without the loop below
                token_id = token_ids[0]
                request.output_token_ids.append(token_id)
                all_token_ids.append(token_id)
                if (
                    len(all_token_ids) < request.max_num_tokens
                    and token_id not in request.eos_token_ids
                    and token_id not in request.stop_token_ids
                ):
                    append_output(new_output(RequestStepOutput, (request_id, token_ids, _RUNNING, None)))
                    continue
                status = self._check_stop(request, token_id)
            else:
                token_ids, status = self._append_tokens(request, token_ids)
            if status is not _RUNNING:
                request.status = status
                self._release(request)
                any_finished = True
            append_output(new_output(RequestStepOutput, (request_id, token_ids, status, request.stop_reason)))
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    # ------------------------------------------------------------------ internals

    def _snapshot_ops(self, plan: _StepPlan) -> SnapshotOps:
        """The step's copies between the recurrent states and their snapshots (none without snapshots)."""
        snapshots = self.kv_cache_manager.snapshots
        if snapshots is None:
            return SnapshotOps()
        requests, computed = self.requests, plan.num_computed
        scheduled = [(requests[i], computed[i], n) for i, n in plan.num_scheduled.items()]
        return snapshots.take_ops(self.num_steps, scheduled)

    def _observe_features(self, draft_features: Mapping[str, object]) -> None:
        """The step's features of the requests still running, with their tokens before the step's, to the feature
        proposer (one that opted out of speculation never drafts: nothing of it is kept)."""
        assert self._feature_proposer is not None
        requests = []
        for request_id in draft_features:
            request = self.requests.get(request_id)
            if request is not None and request.status is _RUNNING and request.num_speculative_tokens != 0:
                requests.append(DraftQuery(request_id, request.all_token_ids, 0, request.block_hashes))
        if requests:
            self._feature_proposer.observe(draft_features, requests)

    def _schedule_decodes(self, plan: _StepPlan, running: list[Request]) -> None:
        """One token for every request of `running` (a copy of the running ones not in flight) at the end of its
        sequence.

        The hot loop: it records into `plan` directly (what `_StepPlan.add` does, without
        the budget, which `schedule` settles once afterwards)."""
        allocate_slots = self.kv_cache_manager.allocate_slots
        slots = self.kv_cache_manager.num_slots
        block_size = self.block_size
        num_scheduled = plan.num_scheduled
        num_computed = plan.num_computed
        new_block_ids = plan.new_block_ids
        for request in running:
            if request.status is not _RUNNING:
                continue  # preempted earlier in this loop
            computed = request.num_computed_tokens
            if len(request.all_token_ids) - computed > 1:
                continue  # still in its prompt
            request_id = request.request_id
            if computed + 1 <= slots[request_id] and (computed + 1) % block_size:
                # Inside its allocated slots without filling a block: nothing for the KV manager to do.
                num_scheduled[request_id] = 1
                num_computed[request_id] = computed
                continue
            new_blocks = allocate_slots(request, 1)
            if new_blocks is None:
                self._schedule_running(plan, request, 1)
                continue
            num_scheduled[request_id] = 1
            num_computed[request_id] = computed
            if any(new_blocks):
                new_block_ids[request_id] = new_blocks

    def _schedule_decodes_with_drafts(
        self, plan: _StepPlan, proposer: AnyDraftProposer, running: list[Request]
    ) -> None:
        """`_schedule_decodes`, each decode with up to k draft tokens while the budget lasts.

        The budget left after one token per decode goes to drafts in the running order. A draft's
        slots are lookahead slots: allocated, but not counted when the step's full blocks are hashed."""
        decoding = [r for r in running if len(r.all_token_ids) - r.num_computed_tokens <= 1]
        spare = self.scheduler_config.max_num_batched_tokens - len(decoding)
        if self.max_drafting_batch is not None and len(decoding) > self.max_drafting_batch:
            spare = 0  # a batch this large is compute-bound: verification rows would cost more than they save
        proposals = self._proposals(proposer, decoding, spare)
        spare -= sum(len(drafts) for _, drafts in proposals)
        unweighed = spare < self.scheduler_config.max_num_batched_tokens - len(decoding)
        if self.step_cost is not None and unweighed and not isinstance(proposer, BatchDraftProposer):
            proposals = self._paying(proposals, self.step_cost)
        # Every decode's own token first (these may preempt, as without drafts); then the drafts, in the running
        # order, from the blocks still free: a draft never costs another request its place.
        for request, _ in proposals:
            if request.status is _RUNNING:  # (not preempted earlier in this loop)
                self._schedule_running(plan, request, 1)
        kv = self.kv_cache_manager
        for request, drafts in proposals:
            if not drafts or request.status is not _RUNNING or request.request_id not in plan.num_scheduled:
                continue  # (no drafts, preempted, or waiting for blocks behind the steps in flight)
            new_blocks = kv.allocate_slots(request, 1, num_lookahead_tokens=len(drafts))
            if new_blocks is not None:  # None: not enough free blocks now, it decodes without drafts
                plan.extend(request, drafts, new_blocks)

    def _paying(
        self,
        proposals: list[tuple[Request, tuple[int, ...]]],
        step_cost: StepCost,
        draft_cost: Optional[StepCost] = None,
    ) -> list[tuple[Request, tuple[int, ...]]]:
        """`_drafts_that_pay`, the requests whose drafts it drops drifting back towards trying again."""
        paying = self._drafts_that_pay(proposals, step_cost, draft_cost)
        for (request, drafts), (_, kept) in zip(proposals, paying):
            if drafts and not kept:
                # Unverified drafts teach nothing: the estimate drifts back up, so that a request whose
                # text turns copyable is tried again within a few steps.
                request.draft_acceptance += (1.0 - request.draft_acceptance) * DRAFT_RETRY_DRIFT
        return paying

    @staticmethod
    def _drafts_that_pay(
        proposals: list[tuple[Request, tuple[int, ...]]],
        step_cost: StepCost,
        draft_cost: Optional[StepCost] = None,
    ) -> list[tuple[Request, tuple[int, ...]]]:
        """The proposals whose drafts raise the step's expected tokens per second, the others without drafts.

        A request's drafts are expected to add sum(a^j, j = 1..n) tokens, a its recent acceptance. Requests
        are taken best first (expected tokens per draft row), and the leading run of them with the most
        expected tokens per second is kept: in a small batch the rows are almost free (the step reads the
        weights once whatever its rows), in a large one each row costs what it computes and only drafts that
        are likely right pay for theirs. With `draft_cost`, a draft model's forwards (as many as the longest
        draft, over the requests drafted for) count too: nearly a fixed cost, which several requests' drafts
        may pay together where one's alone would not."""

        def expected(request: Request, num_drafts: int) -> float:
            a = request.draft_acceptance
            return sum(a**j for j in range(1, num_drafts + 1))

        def cost(rows: int, drafting: int, longest: int) -> float:
            extra = draft_cost(drafting) * longest if draft_cost is not None and drafting else 0.0
            return step_cost(rows) + extra

        rows, tokens, longest = len(proposals), float(len(proposals)), 0
        gains = {i: expected(request, len(drafts)) for i, (request, drafts) in enumerate(proposals) if drafts}
        order = sorted(gains, key=lambda i: -gains[i] / len(proposals[i][1]))
        best, best_rate = 0, tokens / step_cost(rows)
        for drafting, i in enumerate(order, 1):
            rows += len(proposals[i][1])
            tokens += gains[i]
            longest = max(longest, len(proposals[i][1]))
            rate = tokens / cost(rows, drafting, longest)
            if rate > best_rate:
                best, best_rate = drafting, rate
        kept = set(order[:best])
        return [(request, drafts if i in kept else ()) for i, (request, drafts) in enumerate(proposals)]

    def _proposals(
        self, proposer: AnyDraftProposer, decoding: list[Request], spare: int
    ) -> list[tuple[Request, tuple[int, ...]]]:
        """Each decoding request's drafts, in the running order while the spare budget lasts. A per-request
        proposer is asked one request at a time (what one gets short leaves budget to the next); a batched one
        once, each request reserving its whole limit."""
        k = proposer.num_speculative_tokens
        if not isinstance(proposer, BatchDraftProposer):
            proposals = []
            for request in decoding:
                limit = self._draft_limit(request, k, spare)
                drafts = tuple(proposer.propose(request.all_token_ids, limit)[:limit]) if limit > 0 else ()
                spare -= len(drafts)
                proposals.append((request, drafts))
            return proposals
        planned = []
        for request in decoding:
            limit = self._draft_limit(request, k, spare)
            spare -= limit
            planned.append((request, (0,) * limit))  # placeholders: what each request would verify
        if self.step_cost is not None and any(limit for _, limit in planned):
            # Weighed before proposing: a draft model's forwards are the cost of drafting itself.
            planned = self._paying(planned, self.step_cost, self.draft_cost)
        queries = [
            DraftQuery(r.request_id, r.all_token_ids, len(slots), r.block_hashes) for r, slots in planned if slots
        ]
        drafted = proposer.propose_batch(queries) if queries else []
        by_id = {query.request_id: tuple(drafts[: query.max_num_tokens]) for query, drafts in zip(queries, drafted)}
        return [(request, by_id.get(request.request_id, ())) for request in decoding]

    def _draft_limit(self, request: Request, k: int, spare: int) -> int:
        """The most drafts a request gets: its own k (adaptive, capped by the request), the budget's spare
        tokens, and one fewer than the tokens it may still produce (the step adds one beyond the accepted
        drafts)."""
        if spare <= 0:
            return 0
        if self.adaptive_drafts:
            k = 1 + int((k - 1) * request.draft_acceptance + 0.5)
        if request.num_speculative_tokens is not None:
            k = min(k, request.num_speculative_tokens)
        return min(k, spare, request.max_num_tokens - request.num_tokens - 1)

    def _num_rejected(self, request: Request, drafts: tuple[int, ...], token_ids: Optional[Sequence[int]]) -> int:
        """Drafts of a verified request that were not accepted, counted into the statistics and the request's
        acceptance; the runner returns the accepted drafts and one token more."""
        num_accepted = max(len(token_ids) - 1, 0) if token_ids else 0
        if num_accepted > len(drafts):
            raise ValueError(f"{num_accepted + 1} tokens back for {len(drafts)} drafts")
        if self.spec_decode_stats is not None:
            self.spec_decode_stats.record(len(drafts), num_accepted)
        # Half weight to the latest verification: a request that starts or stops copying adapts in a few steps.
        request.draft_acceptance = (request.draft_acceptance + num_accepted / len(drafts)) / 2
        return len(drafts) - num_accepted

    def _schedule_running(self, plan: _StepPlan, request: Request, num_tokens: int) -> bool:
        """Allocate for a running request, preempting others until it fits (or is itself preempted, or waits
        for steps in flight: see the class docstring)."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_tokens)
            if new_blocks is not None:
                plan.add(request, num_tokens, new_blocks)
                return True
            victim = self._pick_victim(request)
            if victim is None:
                plan.waits_for_blocks = True
                return False
            self._preempt(victim)
            plan.drop(victim.request_id)
            plan.preempted.append(victim.request_id)
            if victim is request:
                return False

    def _chunk_length(self, request: Request, start: int, num_left: int, budget: int) -> int:
        """The tokens a prompt chunk from `start` computes in a step with `budget` left: within the budget and
        the chunk cap, and ending outside the request's bidirectional spans (0: its next span does not fit)."""
        num_tokens = min(num_left, budget, self._chunk_cap)
        spans = request.bidirectional_spans
        return chunk_length(spans, start, num_tokens, budget) if spans else num_tokens

    @property
    def _chunk_cap(self) -> int:
        """The most prompt tokens one request computes in a step: --long-prefill-token-threshold, else the
        whole budget."""
        config = self.scheduler_config
        return config.long_prefill_token_threshold or config.max_num_batched_tokens

    def _fair_share(self) -> int:
        """The most requests one of N steps in flight schedules: an N-th of those running and admissible.

        Without it every running request would be in one step and the next N - 1 steps empty (all in flight),
        so pipeline stages would never overlap. Shared, the running requests settle into N groups that take
        turns (each step's candidates are those not in flight: the group just updated, and any left over)."""
        num_running = len(self.running)
        num_admissible = min(len(self.waiting), self.scheduler_config.max_num_seqs - num_running)
        return max(-(-(num_running + num_admissible) // self.max_concurrent_batches), 1)

    def _admit_waiting(self, plan: _StepPlan, max_requests: int) -> None:
        """Admit from the queue's head while the budget, max_num_seqs and `max_requests` (this step's) allow.

        A request whose LoRA adapters would take more than max_loras slots is set aside for this step (vLLM's
        rule), so base requests and those of adapters already running are not held up behind it."""
        set_aside: list[Request] = []
        try:
            self._admit_from_head(plan, max_requests, set_aside)
        finally:
            for request in reversed(set_aside):
                self.waiting.add_front(request)

    def running_adapters(self) -> set[str]:
        """The distinct LoRA adapters of the running requests."""
        return {key for r in self.running for key in r.lora_adapters}

    def _admit_from_head(self, plan: _StepPlan, max_requests: int, set_aside: list[Request]) -> None:
        max_num_seqs = self.scheduler_config.max_num_seqs
        kv = self.kv_cache_manager
        adapters = self.running_adapters() if self.max_loras is not None else set()
        while (
            len(self.waiting)
            and plan.budget > 0
            and len(self.running) < max_num_seqs
            and len(plan.num_scheduled) < max_requests
        ):
            request = self.waiting.peek()
            if request.request_id in self._in_flight:
                break
            if self.max_loras is not None and request.lora_adapters:
                if len(adapters.union(request.lora_adapters)) > self.max_loras:
                    set_aside.append(self.waiting.pop())
                    continue  # an ended request of the same id is in a step in flight: its update must not reach this one
            computed_blocks, num_hit = kv.get_computed_blocks(request)
            if kv.next_block_pending(request, num_hit // self.block_size):
                break  # its next block is being computed now: hit it next step, don't compute it twice
            num_restored = kv.tier_hits(request, num_hit // self.block_size)  # read in, not computed
            if num_restored and kv.next_block_pending(request, num_hit // self.block_size + num_restored):
                break
            num_hit += num_restored * self.block_size
            num_left = request.num_tokens - num_hit
            num_tokens = self._chunk_length(request, num_hit, num_left, plan.budget)
            if not num_tokens:
                break  # its first span does not fit what is left of this step: it heads the queue for the next
            # Blocks for the whole rest of the prompt, not just this chunk: a request admitted
            # without them would be preempted by its own next chunk and lose its work, repeatedly.
            new_blocks = kv.allocate_slots(
                request,
                num_tokens,
                computed_blocks,
                num_reserved_tokens=num_left - num_tokens,
                num_restored_blocks=num_restored,
            )
            if new_blocks is None:
                break  # head of the queue waits for blocks; later ones wait behind it
            self.waiting.pop()
            adapters.update(request.lora_adapters)
            request.status = _RUNNING
            request.num_computed_tokens = num_hit
            if not request.num_preemptions:
                # The prompt tokens the prefix cache served (usage's cached_tokens, and the prefix-cache
                # counters, as vLLM counts them): at the first admission only. A resumed request's hit covers
                # its own recomputed prompt and output tokens, which are neither cached prompt tokens nor
                # bounded by the prompt: counted, they would raise the hit rate with every preemption.
                request.num_cached_tokens = num_hit
                kv.record_admission(request, num_hit)
            self.running.append(request)
            plan.add(request, num_tokens)
            plan.new_requests.append(
                NewRequestData(
                    request.request_id,
                    token_array(request.all_token_ids),
                    request.num_prompt_tokens,
                    kv.get_block_ids(request.request_id),
                    num_hit,
                    request.sampling_params,
                    request.eos_token_ids,
                    request.grammar,
                    request.lora,
                    request.multi_modal,
                )
            )

    def _pick_victim(self, requester: Request) -> Optional[Request]:
        """The policy's victim among the running requests not in flight; None: `requester` waits instead."""
        in_flight = self._in_flight
        candidates = [r for r in self.running if r.request_id not in in_flight] if in_flight else self.running
        if self.scheduler_config.policy == "priority":
            victim = max(candidates, key=lambda r: (r.priority, r.arrival_time))
        else:
            victim = candidates[-1]
        if victim is requester and in_flight:
            return None
        return victim

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        if isinstance(self.proposer, BatchDraftProposer):
            self.proposer.release(request.request_id)  # its draft state is memory too; rebuilt on resuming
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(request)

    def _append_tokens(self, request: Request, token_ids: Sequence[int]) -> tuple[Sequence[int], RequestStatus]:
        """Several tokens in one step: append them up to the first that stops the request."""
        for i, token_id in enumerate(token_ids):
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not _RUNNING:
                return token_ids[: i + 1], status
        return token_ids, _RUNNING

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus:
        """Token-level stop rules, after `token_id` was appended."""
        num_output = len(request.output_token_ids)
        if num_output >= request.min_tokens:
            if token_id in request.eos_token_ids and not request.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in request.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if len(request.all_token_ids) >= request.max_num_tokens:  # max_tokens reached (within max_model_len)
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return _RUNNING

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is _RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self.waiting.remove(request)
        request.status = status
        self._release(request)

    def _release(self, request: Request) -> None:
        if self.proposer is not None:
            self.proposer.on_request_finished(request.output_token_ids)
            if isinstance(self.proposer, BatchDraftProposer):
                self.proposer.release(request.request_id)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.add(request.request_id)

    def check_request(self, request: Request) -> None:
        """Raise a RequestRejectedError if the request could never be served (changes nothing)."""
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError("a new request must be WAITING with nothing computed")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise EmptyPromptError()
        total = num_prompt + request.max_tokens
        if total > self.max_model_len:
            raise ContextLengthExceededError(num_prompt, request.max_tokens, self.max_model_len)
        kv = self.kv_cache_manager
        # The last sampled token is never fed back, so it needs no slot.
        max_step_tokens = self.scheduler_config.max_num_batched_tokens
        span_tokens = longest_span(request.bidirectional_spans)
        if span_tokens > max_step_tokens:  # (it could never be scheduled)
            raise MediaSpanTooLongError(span_tokens, max_step_tokens)
        num_blocks = kv.num_blocks_needed(max(total - 1, num_prompt), max_step_tokens)
        if num_blocks > kv.num_blocks:
            # (the prompt alone: it is at fault whatever max_tokens is, one max_tokens None resolved to included)
            prompt_alone = kv.num_blocks_needed(num_prompt, max_step_tokens) > kv.num_blocks
            raise KVCacheTooSmallError(
                num_prompt, request.max_tokens, num_blocks, kv.num_blocks, self.block_size, prompt_alone
            )
