"""Turns a SchedulerOutput into one forward pass and the sampled tokens."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch

from engine.attention import AttentionBackend, StepMetadata
from engine.attention.step_metadata import computes_bidirectional_spans
from engine.attention.torch_backend import TorchAttentionBackend
from engine.lora.lora_manager import LoRARef
from engine.lora.lora_slots import LoRASlots
from engine.lora.lora_step import LoRASegment, LoRAStep, lm_head_rows
from engine.models.llama import LlamaForCausalLM
from engine.layers.mrope import SectionedRows
from engine.layers.recurrent_state import RecurrentStates, RecurrentStep
from engine.models.vision_language import VisionEncoder
from engine.multimodal.inputs import MultiModalInputs
from engine.runner.block_table import BlockTable
from engine.runner.cuda_graphs import CudaGraph, DecodeGraphs, ForwardFn, model_forward
from engine.runner.fault_isolation import GuardedSampler
from engine.runner.peer_step import PeerStep, StepPeers
from engine.attention.kv_cache import KVCache
from engine.kv_tier.disk_tier import DiskTier
from engine.kv_tier.memory_tier import MemoryTier
from engine.runner.step_buffers import StepBuffers
from engine.profiling.step_profile import StepProfile
from engine.outputs import ModelRunnerOutput
from engine.pooling import pooler
from engine.pooling.params import Pooling
from engine.sampling.device_io import to_device
from engine.sampling.rejection_sampler import num_accepted
from engine.sampling.sampler import Sampler, TokenLogprobs, prompt_logprobs
from engine.sampling.state import SamplingState
from engine.sampling.params import SamplingParams
from engine.structured.grammar_decoder import GrammarDecoder, accept
from engine.structured.grammar_ref import GrammarRef
from scheduler import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    import xgrammar


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps about a request while it holds KV blocks.

    Built from the step message's NewRequestData when the request is admitted or
    resumed, dropped when it is preempted or has ended: nothing survives a
    preemption (a seeded request's draws depend on its seed and output position only).
    """

    request_id: str
    num_prompt_tokens: int
    sampling: Optional[SamplingState]  # None: a pooling request's, which samples nothing
    row: int  # in the runner's BlockTable, which holds the request's block ids
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    matcher: Optional["xgrammar.GrammarMatcher"] = None  # when the request is constrained
    lora_slots: tuple[tuple[int, float], ...] = ()  # its adapters' (slot, scale) pairs; empty: the base model
    pooling: Optional[Pooling] = None  # a pooling request's: how its prompt's final hidden states are pooled
    pooled: Optional[torch.Tensor] = None  # [hidden] float32: the sum of its rows pooled so far
    multi_modal: Optional[MultiModalInputs] = None  # a prompt's images
    # Its images' embeddings (by image index), from the first step that computes one of an image's positions to
    # the step that computes its last: a chunk ending inside an image leaves the rest for the next chunks.
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling is not None and self.sampling.params.prompt_logprobs is not None

    @property
    def sampler_state(self) -> SamplingState:
        """The sampling state of a request that samples (every request in a step's sample rows)."""
        assert self.sampling is not None, "a pooling request reached the sampler"
        return self.sampling


def _request_id_lookup(requests: dict[str, CachedRequestState]) -> Callable[[SamplingState], str]:
    """sampling state -> its request's id, over the runner's live requests (a closure over the dict, not a
    bound method: the sampler is the runner's, and a sampler -> runner reference would make a cycle)."""

    def request_id_of(sampling: SamplingState) -> str:
        own = sampling.origin or sampling  # a row after draft tokens samples with a copy of the state
        return next(rid for rid, state in requests.items() if state.sampling is own)

    return request_id_of


@dataclass(frozen=True, slots=True)
class RunnerLimits:
    """The scheduler's limits, which size the runner's persistent step buffers."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_speculative_tokens: int = 0  # draft tokens a request may verify per step
    # a hybrid model's snapshots of recurrent states (scheduler/state_snapshots.py); None: no recurrent state at all
    num_state_snapshots: Optional[int] = None

    @property
    def max_query_rows(self) -> int:
        """Attention queries of one step at most: a request verifying k drafts is k + 1 of them."""
        return min(self.max_num_batched_tokens, self.max_num_seqs * (1 + self.num_speculative_tokens))


@dataclass(slots=True)
class _Batch:
    """What the step samples and scores, besides the inputs written into the step buffers."""

    num_tokens: int = 0
    sample_rows: list[int] = field(default_factory=list)
    sample_states: list[CachedRequestState] = field(default_factory=list)
    prompt_rows: list[tuple[CachedRequestState, int, int, int]] = field(default_factory=list)  # state, row, count, pos0
    pool_rows: list[tuple[CachedRequestState, int, int, bool]] = field(default_factory=list)  # state, row, count, last
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # first of a request's sample rows -> its drafts
    image_rows: list[int] = field(default_factory=list)  # rows whose input is an image embedding, not a token's
    image_embeds: list[torch.Tensor] = field(default_factory=list)  # those rows' embeddings, in their order
    bidirectional: list[tuple[int, int]] = field(default_factory=list)  # row ranges of images seen both ways
    # multimodal RoPE: the image rows whose position differs per component, and their [n, 3] positions
    rope_rows: list[int] = field(default_factory=list)
    rope_positions: list[torch.Tensor] = field(default_factory=list)
    lora: Optional[LoRAStep] = None  # the step's adapter deltas (None: no token runs with an adapter)
    # each request's rows, with the runner's `draft_features` on: (request id, first row, count, first position)
    feature_rows: list[tuple[str, int, int, int]] = field(default_factory=list)
    recurrent: Optional[RecurrentStep] = None  # a hybrid model's requests' recurrent states (their rows)


class ModelRunner:
    """Owns the model, the physical KV cache and per-request sampling state."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        limits: RunnerLimits,
        *,
        grammar: Optional[GrammarDecoder] = None,
        profile: Optional[StepProfile] = None,
        peers: Optional[StepPeers] = None,
        samples: bool = True,
        kv_tier: Optional[DiskTier] = None,
        memory_tier: Optional[MemoryTier] = None,
        vision: Optional[VisionEncoder] = None,
    ):
        """`grammar` decodes structured-output constraints (None: a runner that is never given one);
        `profile` times each step's phases (`--profile`). Tensor parallelism: rank 0's runner hands every step
        message to its `peers` (the other ranks' runners, in worker processes) before running it, with the
        tokens it sampled in the step before; a peer's runner (`samples` False) runs the same forward passes
        over its shard, takes those tokens (`take_sampled`), computes its slice of the same logits (the LM head
        is vocab-parallel: rank 0 gathers the slices) and samples nothing. `kv_tier`, `memory_tier`: this rank's
        side of the disk and host-memory KV tiers, which the step message's restores are read from and its saves
        written to. `vision`: a vision-language model's image encoder, which the runner runs on a request's images
        as its prompt's chunks reach them (their embeddings replace the placeholder tokens' in the model's input)."""
        self.model: Optional[LlamaForCausalLM] = model  # None once shut down (as are _forward and buffers)
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.limits = limits
        self.requests: dict[str, CachedRequestState] = {}
        # the cpu backends' kernels: sampled rows drawn in one native call, prompt logprobs row by row, the
        # logits processors (logit_bias, min_tokens, penalties) in one call
        kernels = getattr(backend, "kernels", None) if device.type == "cpu" else None
        self._row_logprobs = None if kernels is None else kernels.row_logprobs
        sampler = Sampler(
            native_rows=None if kernels is None else kernels.sample_rows,
            native_logprobs=self._row_logprobs,
            native_processors=None if kernels is None else kernels.logit_processors,
        )
        self.sampler = GuardedSampler(sampler, _request_id_lookup(self.requests))  # a bad row fails alone
        block_size = kv_cache.spec.block_size
        max_blocks = -(-limits.max_model_len // block_size)
        self.num_groups = len(kv_cache.spec.groups)  # KV layer groups: a block table and slot mapping each
        self.block_table = BlockTable(
            block_size, rows=limits.max_num_seqs, width=max_blocks, num_groups=self.num_groups
        )
        self.buffers: Optional[StepBuffers] = StepBuffers(
            limits.max_num_batched_tokens, limits.max_query_rows, max_blocks, device, self.num_groups
        )
        self._forward: Optional[ForwardFn] = model_forward(model, backend, kv_cache)
        # a hybrid model's recurrent states, a row per request: its block table row (layers/recurrent_state.py)
        self.states: Optional[RecurrentStates] = model.recurrent_states(
            limits.max_num_seqs, limits.num_state_snapshots or 0
        )
        self.graphs: Optional[DecodeGraphs] = None  # set by capture_decode_graphs
        self.profile = profile
        self.grammar = grammar
        self.peers = peers
        self.samples = samples
        self._sampled: dict[str, list[int]] = {}  # the last step's tokens, for the peers' next message
        self.lora_slots = None if model.lora is None else LoRASlots(model.lora)  # which slot holds which adapter
        self.kv_tier = kv_tier
        self.memory_tier = memory_tier
        self.vision = vision
        # What an EAGLE proposer reads of each step (the step output's draft_features): "final" (the rows' final
        # hidden states), "tapped" (the residual stream entering the model's feature_layers, side by side), or
        # None (no features)
        self.draft_features: Optional[str] = None
        # A model whose images attend both ways, over a backend that computes causal attention only: the steps
        # that compute an image run through the torch backend (over the same cache), the others through `backend`.
        self._span_forward: Optional[ForwardFn] = None
        if vision is not None and vision.family.bidirectional_images and not computes_bidirectional_spans(backend):
            self._span_forward = model_forward(model, TorchAttentionBackend(), kv_cache)

    def take_sampled(self, sampled: dict[str, list[int]]) -> None:
        """A peer's runner: the tokens rank 0 sampled in the last step (accepted drafts included), appended as
        rank 0's runner appended them."""
        for request_id, token_ids in sampled.items():
            state = self.requests.get(request_id)
            if state is not None:
                state.token_ids += token_ids
                state.sampler_state.output_token_ids += token_ids

    def remove_request(self, request_id: str) -> None:
        """Forget a request that has ended (its state and its table row)."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.block_table.release(state.row)
            if state.lora_slots and self.lora_slots is not None:
                self.lora_slots.release(state.lora_slots)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.peers is None:
            return self._execute(scheduler_output)
        # Every rank runs every step, in the same order, so that their collectives pair up. A step that fails here
        # after the peers took it leaves them at another collective than this rank: no later step may run.
        self.peers.send(PeerStep(scheduler_output, self._sampled))
        self._sampled = {}
        try:
            return self._execute(scheduler_output)
        except BaseException as error:
            self.peers.fail(error)
            raise

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        buffers, forward = self.buffers, self._forward
        assert buffers is not None and forward is not None  # not shut down (no step runs after)
        buffers.begin_step()
        batch, steps, bucket = self._prepare_inputs(scheduler_output)
        model = self.model
        assert model is not None
        model.lora_step = batch.lora  # read by the forward pass and the logits; cleared when the step ends
        model.recurrent_step = batch.recurrent
        model.tapped_features = {}  # (a step that failed may have left some)
        try:
            output = self._run_step(batch, steps, bucket)
        finally:
            model.lora_step = model.recurrent_step = None
        self._save_after_forward(scheduler_output)
        return output

    def _save_after_forward(self, scheduler_output: SchedulerOutput) -> None:
        """Copy the blocks the step's forward filled out to the KV tiers (before a later step may reuse them), and
        the recurrent states that reached a snapshot at the step's end to their slots."""
        if scheduler_output.state_saves and self.states is not None:
            scheduled, computed = scheduler_output.num_scheduled_tokens, scheduler_output.num_computed_tokens
            ends = [
                (self.requests[request_id].row, self.states.snapshot_row(slot))
                for request_id, position, slot in scheduler_output.state_saves
                if position == computed[request_id] + scheduled[request_id]
            ]
            self.states.copy_rows([row for row, _ in ends], [target for _, target in ends])
        if self.memory_tier is not None and scheduler_output.kv_memory_saves:
            self.memory_tier.save(self.kv_cache, scheduler_output.kv_memory_saves)
        if self.kv_tier is not None and scheduler_output.kv_tier_saves:
            self.kv_tier.save(self.kv_cache, scheduler_output.kv_tier_saves)

    def _run_step(self, batch: _Batch, steps: Optional[list[StepMetadata]], bucket: Optional[int]) -> ModelRunnerOutput:
        buffers, forward, profile = self.buffers, self._forward, self.profile
        assert buffers is not None and forward is not None
        if bucket is not None:
            assert self.graphs is not None  # the bucket is one of theirs
            if profile is not None:
                profile.lap("prepare")
            hidden = self.graphs.replay(bucket)  # its inputs are uploaded
            if self.draft_features == "tapped":
                assert self.model is not None
                self.model.tapped_features = self.graphs.tapped_of(bucket)
        else:
            assert steps is not None  # built whenever no graph replays
            input_ids = buffers.input_ids.upload(batch.num_tokens)
            positions = buffers.positions.upload(batch.num_tokens)
            embeds = self._input_embeddings(input_ids, batch) if batch.image_rows else None
            if batch.bidirectional and self._span_forward is not None:
                forward = self._span_forward
            sectioned = None
            if batch.rope_rows:
                rows = torch.tensor(batch.rope_rows, dtype=torch.int64, device=positions.device)
                sectioned = SectionedRows(rows, torch.cat(batch.rope_positions).to(positions.device))
            if profile is not None:
                profile.lap("prepare")
            if embeds is None:
                hidden = forward(input_ids, positions, steps)
            else:
                hidden = forward(input_ids, positions, steps, embeds, sectioned=sectioned)
        if profile is not None:
            profile.lap("forward")
        if not self.samples:
            try:
                self._contribute_logits(hidden, batch)
            finally:
                buffers.end_step()
            return ModelRunnerOutput()
        try:
            output = self._sample(hidden, batch)
            if batch.feature_rows:
                output = replace(output, draft_features=self._features(hidden, batch))
            if self.peers is not None:
                self._sampled = output.sampled_token_ids
            return output
        finally:
            buffers.end_step()
            if profile is not None:
                profile.lap("sample")

    def _input_embeddings(self, input_ids: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """The step's first-layer input: the tokens' embeddings, the image rows' replaced by their images'."""
        model = self.model
        assert model is not None  # not shut down
        embeds = model.input_embeddings(input_ids)
        rows = torch.tensor(batch.image_rows, dtype=torch.int64, device=embeds.device)
        embeds[rows] = torch.cat(batch.image_embeds).to(device=embeds.device, dtype=embeds.dtype)
        return embeds

    def capture_decode_graphs(self, buckets: tuple[int, ...], graph_type: type = CudaGraph) -> None:
        """Capture (or, with EagerReplay, prepare) the decode graphs; from then on a decode-only step of at
        most `buckets[-1]` requests replays the smallest bucket that holds it."""
        if graph_type is CudaGraph and not self.backend.cuda_graphs:
            raise ValueError(f"attention backend {self.backend.name!r} does not run in CUDA graphs")
        assert self._forward is not None and self.buffers is not None  # not shut down
        assert self.model is not None
        graphs = DecodeGraphs(
            self._forward,
            self.backend,
            self.kv_cache,
            self.buffers,
            buckets,
            self.limits.max_model_len,
            graph_type,
            self.model.lora,  # (with LoRA: captured with static LoRA inputs, so steps with adapters replay)
            _tapped_of(self.model) if self.draft_features == "tapped" else None,
        )
        graphs.capture()
        self.graphs = graphs

    def shutdown(self) -> None:
        """Release the decode graphs, the KV cache, the step buffers and the weights (on CUDA, back to the
        allocator's free pool and then to the device), so that another engine in this process gets the
        memory. The runner runs no step after this."""
        self.requests.clear()
        if self.peers is not None:
            self.peers.stop()
        if self.kv_tier is not None:
            self.kv_tier.close()  # the blocks copied out are written before the engine is gone
        if self.memory_tier is not None:
            self.memory_tier.synchronize()  # (no copy may still read the cache released below)
            self.memory_tier = None
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        self.kv_cache.release()
        if self.states is not None:
            self.states.release()
        self.model = self._forward = self.buffers = self.grammar = None
        if self.device.type == "cuda":  # (torch's per-stream cuBLAS workspaces stay: clearing them all would
            torch.cuda.synchronize(self.device)  # free those baked into another live engine's graphs)
            torch.cuda.empty_cache()

    @property
    def cuda_graphs(self) -> str:
        """What runs as CUDA graphs ("off", or the decode batch sizes)."""
        return "off" if self.graphs is None else self.graphs.describe()

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the message's request changes: ended, preempted, new or resumed, new blocks."""
        for request_id in scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids:
            self.remove_request(request_id)
        table = self.block_table
        for new in scheduler_output.new_requests:  # admitted, or resumed after preemption
            self.remove_request(new.request_id)
            state = self.requests[new.request_id] = self._new_state(new)
            table.set(state.row, new.block_ids)
        for request_id, block_ids in scheduler_output.new_block_ids.items():
            table.append(self.requests[request_id].row, block_ids)
        if scheduler_output.state_restores and self.states is not None:  # (a hit's recurrent states)
            states, requests = self.states, self.requests
            restores = scheduler_output.state_restores
            states.copy_rows(
                [states.snapshot_row(slot) for _, slot in restores], [requests[i].row for i, _ in restores]
            )
        if self.memory_tier is not None and scheduler_output.kv_memory_restores:  # in before the forward attends
            self.memory_tier.restore(self.kv_cache, scheduler_output.kv_memory_restores)
        if self.kv_tier is not None and scheduler_output.kv_tier_restores:
            self.kv_tier.restore(self.kv_cache, scheduler_output.kv_tier_restores)

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        params = new.sampling_params
        if isinstance(params, Pooling):
            return CachedRequestState(
                new.request_id,
                new.num_prompt_tokens,
                None,
                self.block_table.acquire(),
                list(new.token_ids),
                lora_slots=self._acquire_lora(new),
                pooling=params,
            )
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {new.request_id!r} reached the runner without SamplingParams or Pooling")
        prompt = list(new.prompt_token_ids)
        sampling = SamplingState.create(params, prompt, list(new.output_token_ids), new.eos_token_ids, self.device)
        matcher = None
        if params.structured_outputs is not None and self.samples:  # rebuilt from the outputs so far after a preemption
            if self.grammar is None:
                raise RuntimeError("a constrained request reached a runner without a grammar decoder")
            held = new.grammar.compiled if isinstance(new.grammar, GrammarRef) else None
            matcher = self.grammar.new_matcher(params.structured_outputs, new.output_token_ids, held)
        multi_modal = new.multi_modal
        if multi_modal is not None and (not isinstance(multi_modal, MultiModalInputs) or self.vision is None):
            raise RuntimeError(f"request {new.request_id!r} brought images to a runner without a vision encoder")
        return CachedRequestState(
            new.request_id,
            new.num_prompt_tokens,
            sampling,
            self.block_table.acquire(),
            list(new.token_ids),
            matcher,
            self._acquire_lora(new),
            multi_modal=multi_modal,
        )

    def _state_splits(
        self, scheduler_output: SchedulerOutput, chunks: list[tuple[CachedRequestState, int, int]], first: int
    ) -> dict[int, list[tuple[int, int]]]:
        """The snapshots the step takes inside its prompt chunks (batch index from `first` -> (offset in its chunk,
        snapshot row)); those at a chunk's end are copied after the forward."""
        assert self.states is not None
        inside: dict[str, list[tuple[int, int]]] = {}
        for request_id, position, slot in scheduler_output.state_saves:
            inside.setdefault(request_id, []).append((position, slot))
        splits: dict[int, list[tuple[int, int]]] = {}
        for i, (state, start, num_tokens) in enumerate(chunks, first):
            for position, slot in sorted(inside.get(state.request_id, ())):
                if start < position < start + num_tokens:
                    splits.setdefault(i, []).append((position - start, self.states.snapshot_row(slot)))
        return splits

    def _acquire_lora(self, new: NewRequestData) -> tuple[tuple[int, float], ...]:
        """The slots of the request's adapters (loaded into free slots where they are not held); () for none."""
        if not isinstance(new.lora, LoRARef):
            return ()
        if self.lora_slots is None:
            raise RuntimeError("a request with LoRA adapters reached a runner built without LoRA")
        return self.lora_slots.acquire(new.lora)

    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[_Batch, Optional[list[StepMetadata]], Optional[int]]:
        """Write the step into the persistent buffers, decodes first, and describe it (a StepMetadata per KV
        layer group: the groups' block tables and slot mappings differ, the rest is shared);
        the third value is the decode graph's bucket when the step replays one (then the buffers hold
        that many rows, padding included, all uploaded, and no StepMetadata is built).

        A "decode" here is any request with one scheduled token (and no prompt logprobs left to score); a
        request verifying k draft tokens is k + 1 decodes over its block table row, each query at its own
        position with the sequence length up to it: causal attention over the cache, which holds every
        row's K/V before any layer attends (so each backend, and the fused CPU decode step, serve it as they
        serve decodes)."""
        decodes: list[tuple[CachedRequestState, int, int]] = []  # state, position, token id
        chunks = []
        spec = scheduler_output.scheduled_spec_decode_tokens
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start = scheduler_output.num_computed_tokens[request_id]
            drafts = spec.get(request_id) if spec else None
            if drafts:
                tokens = (state.token_ids[start], *drafts)
                decodes += [(state, start + i, token_id) for i, token_id in enumerate(tokens)]
            elif (
                num_tokens == 1
                and state.pooling is None
                and (not state.wants_prompt_logprobs or start >= state.num_prompt_tokens - 1)
            ):
                decodes.append((state, start, state.token_ids[start]))
            else:
                chunks.append((state, start, num_tokens))
        num_decodes, num_reqs = len(decodes), len(decodes) + len(chunks)
        buffers = self.buffers
        assert buffers is not None  # not shut down
        buffers.check_fits(scheduler_output.total_num_scheduled_tokens, num_reqs, 0)
        ids, positions = buffers.input_ids.array, buffers.positions.array
        slots = [buffer.array for buffer in buffers.slot_mappings]
        starts, seq_lens = buffers.query_start_loc.array, buffers.seq_lens.array
        rows = np.empty(num_reqs, dtype=np.int64)
        batch = _Batch()
        if num_decodes:
            decode_pos = np.fromiter((pos for _, pos, _ in decodes), dtype=np.int64, count=num_decodes)
            rows[:num_decodes] = [state.row for state, _, _ in decodes]
            ids[:num_decodes] = [token_id for _, _, token_id in decodes]
            positions[:num_decodes] = decode_pos
            for group, group_slots in enumerate(self.block_table.slots_at(rows[:num_decodes], decode_pos)):
                slots[group][:num_decodes] = group_slots
            starts[: num_decodes + 1] = np.arange(num_decodes + 1)
            seq_lens[:num_decodes] = decode_pos + 1
            for i, (state, pos, _) in enumerate(decodes):
                if state.multi_modal is not None:  # (a prompt's last token may be an image's)
                    self._add_image_rows(batch, state, i, pos, 1)
                    if state.multi_modal.mrope:  # at its text rotary position (past the prompt: HF's rope_delta)
                        positions[i] += state.multi_modal.rope_shift(pos)
                if pos + 1 >= len(state.token_ids):  # the sequence's last token, or a draft after it
                    if pos + 1 == len(state.token_ids) and spec and state.request_id in spec:
                        batch.drafts[len(batch.sample_rows)] = spec[state.request_id]
                    batch.sample_rows.append(i)
                    batch.sample_states.append(state)
        else:
            starts[0] = 0
        token = num_decodes
        max_query_len = 1 if num_decodes else 0
        for i, (state, start, num_tokens) in enumerate(chunks, num_decodes):
            end = start + num_tokens
            ids[token : token + num_tokens] = state.token_ids[start:end]
            positions[token : token + num_tokens] = np.arange(start, end)
            if state.multi_modal is not None and state.multi_modal.mrope:
                self._shift_chunk_positions(positions[token : token + num_tokens], state.multi_modal, start)
            for group, group_slots in enumerate(self.block_table.slots(state.row, start, end)):
                slots[group][token : token + num_tokens] = group_slots
            rows[i], starts[i + 1], seq_lens[i] = state.row, token + num_tokens, end
            self._add_chunk_outputs(batch, state, token, start, num_tokens)
            if state.multi_modal is not None:
                self._add_image_rows(batch, state, token, start, num_tokens)
            token += num_tokens
            max_query_len = max(max_query_len, num_tokens)
        batch.num_tokens = token
        if self.draft_features is not None:
            self._add_feature_rows(batch, decodes, chunks)
        segments = None if self.lora_slots is None else self._lora_segments(decodes, chunks)
        max_seq_len = int(seq_lens[:num_reqs].max())
        if self.states is not None:  # (zeroes the rows of requests whose first token this step computes)
            splits = self._state_splits(scheduler_output, chunks, num_decodes) if scheduler_output.state_saves else {}
            batch.recurrent = self.states.step(
                rows.tolist(), starts[: num_reqs + 1].tolist(), seq_lens[:num_reqs].tolist(), num_decodes, splits
            )
        width = -(-max_seq_len // self.block_table.block_size)
        buffers.check_fits(token, num_reqs, width)
        graphs = self.graphs
        bucket = None
        if (
            graphs is not None
            and not chunks
            and not batch.image_rows
            and (segments is None or graphs.takes_lora(segments))
        ):
            bucket = graphs.bucket_for(num_decodes)
        if graphs is not None and bucket is not None:
            for group in range(self.num_groups):
                view = buffers.block_table_view(num_reqs, graphs.width, group)
                self.block_table.gather_into(rows, view, group)
            graphs.pad(num_reqs, bucket)
            buffers.upload_all(bucket, graphs.width)
            if segments is not None:  # the graph's own static LoRA inputs, filled (its padding rows: none)
                batch.lora = graphs.fill_lora(bucket, segments)
            return batch, None, bucket
        if segments is not None:
            model = self.model
            assert model is not None and model.lora is not None
            batch.lora = LoRAStep.build(model.lora, token, segments)
        for group in range(self.num_groups):
            self.block_table.gather_into(rows, buffers.block_table_view(num_reqs, width, group), group)
        query_start_loc = buffers.query_start_loc.upload(num_reqs + 1)
        seq_lens_device = buffers.seq_lens.upload(num_reqs)
        steps = [
            StepMetadata(
                slot_mapping=buffers.slot_mappings[group].upload(token),
                query_start_loc=query_start_loc,
                seq_lens=seq_lens_device,
                block_table=buffers.upload_block_table(num_reqs, width, group),
                query_start_loc_cpu=buffers.query_start_loc.host[: num_reqs + 1],
                seq_lens_cpu=buffers.seq_lens.host[:num_reqs],
                num_decodes=num_decodes,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                bidirectional=tuple(batch.bidirectional),
            )
            for group in range(self.num_groups)
        ]
        return batch, steps, None

    @staticmethod
    def _add_feature_rows(batch: _Batch, decodes: list, chunks: list) -> None:
        """Each request's rows as laid out (a request's verify rows are consecutive decodes), for draft_features."""
        rows = batch.feature_rows
        for i, (state, pos, _) in enumerate(decodes):
            if rows and rows[-1][0] == state.request_id and rows[-1][1] + rows[-1][2] == i:
                request_id, first, count, start = rows[-1]
                rows[-1] = (request_id, first, count + 1, start)
            else:
                rows.append((state.request_id, i, 1, pos))
        token = len(decodes)
        for state, start, count in chunks:
            rows.append((state.request_id, token, count, start))
            token += count

    def _features(self, hidden: torch.Tensor, batch: _Batch) -> dict[str, tuple[int, torch.Tensor]]:
        """The step's draft_features: each request's rows of the features `self.draft_features` names."""
        model = self.model
        assert model is not None
        num_tokens = batch.num_tokens
        if self.draft_features == "tapped":
            tapped, model.tapped_features = model.tapped_features, {}
            features = torch.cat([tapped[i][:num_tokens] for i in model.feature_layers], dim=-1)  # [T, 3 * hidden]
        else:
            features = model.final_hidden(hidden[:num_tokens])
        return {
            request_id: (start, features[first : first + count])
            for request_id, first, count, start in batch.feature_rows
        }

    @staticmethod
    def _lora_segments(decodes: list, chunks: list) -> list[LoRASegment]:
        """The step's rows' LoRA slots, by request: decode rows first, then the chunks, as laid out."""
        segments = [LoRASegment(i, 1, state.lora_slots) for i, (state, _, _) in enumerate(decodes)]
        token = len(decodes)
        for state, _, count in chunks:
            segments.append(LoRASegment(token, count, state.lora_slots))
            token += count
        return segments

    def _add_image_rows(
        self, batch: _Batch, state: CachedRequestState, first_row: int, start: int, num_tokens: int
    ) -> None:
        """The rows of positions [start, start + num_tokens) (laid out from `first_row`) that are image placeholders,
        with their images' embeddings (each image encoded when a step first reaches it, dropped once a step
        reaches its end); the row range of each image whose tokens attend both ways (a step holds such an image
        whole: the scheduler's chunks never cut one)."""
        multi_modal, vision = state.multi_modal, self.vision
        assert multi_modal is not None and vision is not None  # (_new_state)
        end = start + num_tokens
        if start >= multi_modal.end:
            return
        for index, image in enumerate(multi_modal.images):
            if image.end <= start or image.start >= end:
                continue
            if multi_modal.bidirectional and image.num_embeds > 1:
                if image.start < start or image.end > end:
                    raise RuntimeError(
                        f"a step cuts image {index} of request {state.request_id!r}, whose tokens attend both ways"
                    )
                batch.bidirectional.append((first_row + image.start - start, first_row + image.end - start))
            embeds = state.image_embeds.get(index)
            if embeds is None:
                embeds = state.image_embeds[index] = vision.encode(image)
            positions = image.positions
            lo, hi = bisect.bisect_left(positions, start), bisect.bisect_left(positions, end)
            if hi > lo:
                rows = [first_row + p - start for p in positions[lo:hi]]
                batch.image_rows += rows
                batch.image_embeds.append(embeds[lo:hi])
                if image.rope_positions is not None:
                    batch.rope_rows += rows
                    batch.rope_positions.append(image.rope_positions[lo:hi])
            if image.end <= end:
                del state.image_embeds[index]  # (the step holds what it takes of it)

    @staticmethod
    def _shift_chunk_positions(positions: np.ndarray, multi_modal: MultiModalInputs, start: int) -> None:
        """Multimodal RoPE: a chunk's rows (prompt positions start ..) at their text rotary positions, each row
        shifted by the images that end at or before it (an image's own rows are rotated by section instead)."""
        end, previous = start + positions.shape[0], 0
        for image in multi_modal.images:
            if image.end >= end:
                break
            if image.rope_shift != previous:
                positions[max(image.end, start) - start :] += image.rope_shift - previous
            previous = image.rope_shift

    @staticmethod
    def _add_chunk_outputs(
        batch: _Batch, state: CachedRequestState, first_row: int, start: int, num_tokens: int
    ) -> None:
        """What a chunk samples (its last row, at the end of the sequence), scores (prompt logprobs) or pools."""
        end = start + num_tokens
        if state.pooling is not None:
            offset, count = pooler.rows_to_pool(state.pooling, start, num_tokens, state.num_prompt_tokens)
            last = end == state.num_prompt_tokens
            if count or last:
                batch.pool_rows.append((state, first_row + offset, count, last))
            return
        if state.wants_prompt_logprobs:
            # Row of position j predicts token j + 1: rows start .. min(end, prompt - 1) - 1. After a
            # preemption they are scored again; the engine keeps the first score of each position.
            count = min(end, state.num_prompt_tokens - 1) - start
            if count > 0:
                batch.prompt_rows.append((state, first_row, count, start))
        if end == len(state.token_ids):
            batch.sample_rows.append(first_row + num_tokens - 1)
            batch.sample_states.append(state)

    def _sample(self, hidden: torch.Tensor, batch: _Batch, selected: bool = False) -> ModelRunnerOutput:
        """Sample the batch's sample rows of `hidden` [num_tokens, hidden] (`selected`: `hidden` holds only those
        rows, in order, and the batch scores no prompt rows) and score its prompt rows."""
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        prompt_lps: dict[str, list[TokenLogprobs]] = {}
        model, buffers = self.model, self.buffers
        assert model is not None and buffers is not None  # not shut down
        if batch.sample_rows:
            rows = hidden if selected else self._sample_hidden(hidden, batch)
            lm_heads = self._lm_heads([s.lora_slots for s in batch.sample_states]) if batch.lora is not None else []
            logits = model.compute_logits(rows, lm_heads) if lm_heads else model.compute_logits(rows)
            states = self._sampling_states(batch)
            # One matcher per request, at its first row (a request's rows after drafts follow it: fill_bitmask).
            matchers = [
                (i, s.matcher)
                for i, s in enumerate(batch.sample_states)
                if s.matcher is not None and (i == 0 or batch.sample_states[i - 1] is not s)
            ]
            if matchers:
                assert self.grammar is not None  # a request has a matcher only from it (_new_state)
                result = self.sampler(logits, states, self.grammar.fill_bitmask(matchers, len(states), batch.drafts))
            else:
                result = self.sampler(logits, states)
            i = 0
            while i < len(batch.sample_states):
                state = batch.sample_states[i]
                drafts = batch.drafts.get(i, ())
                num_rows = 1 + len(drafts)
                token_ids = result.sampled_token_ids[i : i + num_rows]
                token_ids = token_ids[: num_accepted(token_ids, drafts) + 1]  # accepted drafts, one more
                matcher = state.matcher
                if matcher is not None:
                    for token_id in token_ids:
                        if not accept(matcher, token_id):
                            # the mask let every other token through, so only a grammar that allows no next
                            # token here (a rule that never ends) gives one outside it: the request fails alone
                            # rather than write tokens its grammar never allows
                            self.sampler.failures.setdefault(
                                state.request_id,
                                f"its output grammar allows no token after {len(state.sampler_state.output_token_ids)} "
                                "tokens (a rule that can never end?)",
                            )
                            break
                state.token_ids += token_ids
                state.sampler_state.output_token_ids += token_ids
                sampled[state.request_id] = token_ids
                entries = None if result.logprobs is None else result.logprobs[i : i + len(token_ids)]
                if entries is not None and all(entry is not None for entry in entries):
                    logprobs[state.request_id] = [entry for entry in entries if entry is not None]
                i += num_rows
        for state, first_row, count, pos0 in batch.prompt_rows:
            num_top = state.sampler_state.params.prompt_logprobs
            assert num_top is not None  # a prompt row is scored only when it is asked for (wants_prompt_logprobs)
            lm_heads = self._lm_heads([state.lora_slots] * count) if batch.lora is not None else []
            logits = model.compute_logits(hidden[first_row : first_row + count], lm_heads)
            targets = to_device(state.token_ids[pos0 + 1 : pos0 + 1 + count], torch.int64, hidden.device)
            prompt_lps[state.request_id] = prompt_logprobs(logits, targets, num_top, self._row_logprobs)
        pooled = self._pool(hidden, batch) if batch.pool_rows else {}
        return ModelRunnerOutput(
            sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_lps, pooled=pooled
        )

    def _pool(self, hidden: Optional[torch.Tensor], batch: _Batch) -> dict[str, torch.Tensor]:
        """Add the pool rows of `hidden` [num_tokens, hidden] (every row of the step; None where the step pools
        no row) to their requests' sums, final norm applied; the embeddings of the requests whose prompts this step
        completed."""
        model = self.model
        assert model is not None  # not shut down
        pooled: dict[str, torch.Tensor] = {}
        for state, first_row, count, last in batch.pool_rows:
            if count:
                assert hidden is not None  # (returns_every_row)
                rows = model.final_hidden(hidden[first_row : first_row + count])  # [count, hidden]
                state.pooled = pooler.add_rows(state.pooled, rows)
            if last:
                assert state.pooling is not None and state.pooled is not None  # (its rows came first)
                pooled[state.request_id] = pooler.finish(
                    state.pooled, state.pooling, state.num_prompt_tokens, model.classifier
                )
        return pooled

    def _lm_heads(self, row_slots: list[tuple[tuple[int, float], ...]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The logits rows whose adapter replaces the LM head (modules_to_save), with its matrix."""
        model = self.model
        assert model is not None and model.lora is not None
        return lm_head_rows(model.lora, row_slots, self.device)

    def _sample_hidden(self, hidden: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """hidden [num_tokens, hidden] -> the sample rows' [num_samples, hidden]: `hidden` itself when those are
        all its rows (on a CUDA graph its static output, read before the next replay)."""
        rows = batch.sample_rows
        if rows and len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1:
            return hidden  # every row, in order (rows only increase): a decode step's; no gather to pay
        buffers = self.buffers
        assert buffers is not None  # not shut down
        sample_rows = buffers.sample_rows
        sample_rows.array[: len(batch.sample_rows)] = batch.sample_rows
        return hidden.index_select(0, sample_rows.upload(len(batch.sample_rows)))

    def _contribute_logits(self, hidden: torch.Tensor, batch: _Batch, selected: bool = False) -> None:
        """A peer's runner: the logits `_sample` computes, row for row and call for call (each call gathers every
        rank's vocabulary slice), thrown away: rank 0 samples and scores."""
        model = self.model
        assert model is not None  # not shut down
        if batch.sample_rows:
            model.compute_logits(hidden if selected else self._sample_hidden(hidden, batch))
        for _, first_row, count, _ in batch.prompt_rows:
            model.compute_logits(hidden[first_row : first_row + count])

    @staticmethod
    def _sampling_states(batch: _Batch) -> list[SamplingState]:
        """The sampling state of every sample row: a request's own, and for its rows after j draft tokens
        the state it will have once they are accepted."""
        states = [s.sampler_state for s in batch.sample_states]
        for first, drafts in batch.drafts.items():
            own = states[first]
            for j in range(1, len(drafts) + 1):
                states[first + j] = own.after(drafts[:j])
        return states


def _tapped_of(model: LlamaForCausalLM) -> Callable[[], dict[int, torch.Tensor]]:
    """The model's tapped features after a forward (a closure over the model alone: the graphs keep it)."""
    return lambda: model.tapped_features
