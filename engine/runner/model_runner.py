"""Turns a SchedulerOutput into one forward pass and the sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata, PrefillChunk
from engine.runner.block_table import BlockTable
from engine.runner.kv_cache import KVCache
from engine.models.llama import LlamaForCausalLM
from engine.outputs import ModelRunnerOutput
from engine.sampling.sampler import Sampler, TokenLogprobs, prompt_logprobs
from engine.sampling.state import SamplingState
from engine.sampling.params import SamplingParams
from scheduler import NewRequestData, SchedulerOutput


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps about a request while it holds KV blocks.

    Built from the step message's NewRequestData when the request is admitted or
    resumed, dropped when it is preempted or has ended: nothing survives a
    preemption (a seeded request's draws depend on its seed and output position only).
    """

    request_id: str
    num_prompt_tokens: int
    sampling: SamplingState
    row: int  # in the runner's BlockTable, which holds the request's block ids
    token_ids: list[int] = field(default_factory=list)  # prompt + output

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling.params.prompt_logprobs is not None


@dataclass(slots=True)
class _Batch:
    """The flat token batch of one step, decodes first."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    decode_rows: list[int] = field(default_factory=list)  # BlockTable rows
    decode_lens: list[int] = field(default_factory=list)
    prefill_spans: list[tuple[CachedRequestState, int, int, int]] = field(default_factory=list)  # state, start, len, pos0
    sample_rows: list[int] = field(default_factory=list)
    sample_states: list[CachedRequestState] = field(default_factory=list)
    prompt_rows: list[tuple[CachedRequestState, int, int]] = field(default_factory=list)  # state, first row, count


class ModelRunner:
    """Owns the model, the physical KV cache and per-request sampling state."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.block_table = BlockTable(kv_cache.spec.block_size)
        self._inputs = _HostBuffers()

    def remove_request(self, request_id: str) -> None:
        """Forget a request that has ended (its state and its table row)."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.block_table.release(state.row)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        batch = self._build_batch(scheduler_output)
        metadata = self._attention_metadata(batch)
        input_ids = self._inputs.put("input_ids", batch.input_ids, self.device)
        positions = self._inputs.put("positions", batch.positions, self.device)
        hidden = self.model.forward(input_ids, positions, self.kv_cache.layers, metadata, self.backend)
        return self._sample(hidden, batch)

    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the message's request changes: ended, preempted, new or resumed, new blocks."""
        for request_id in so.finished_request_ids | so.preempted_request_ids:
            self.remove_request(request_id)
        table = self.block_table
        for new in so.new_requests:  # admitted, or resumed after preemption
            self.remove_request(new.request_id)
            state = self.requests[new.request_id] = self._new_state(new)
            table.set(state.row, new.block_ids)
        for request_id, block_ids in so.new_block_ids.items():
            table.append(self.requests[request_id].row, block_ids)

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        params = new.sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {new.request_id!r} reached the runner without SamplingParams")
        prompt = list(new.prompt_token_ids)
        sampling = SamplingState.create(params, prompt, list(new.output_token_ids), new.eos_token_ids, self.device)
        return CachedRequestState(new.request_id, new.num_prompt_tokens, sampling, self.block_table.acquire(),
                                  list(new.token_ids))

    def _build_batch(self, so: SchedulerOutput) -> _Batch:
        batch = _Batch()
        table = self.block_table
        chunks = []
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start = so.num_computed_tokens[request_id]
            if num_tokens != 1 or state.wants_prompt_logprobs:
                chunks.append((state, start, num_tokens))
                continue
            batch.input_ids.append(state.token_ids[start])
            batch.positions.append(start)
            batch.slots.append(table.slot(state.row, start))
            batch.decode_rows.append(state.row)
            batch.decode_lens.append(start + 1)
            if start + 1 == len(state.token_ids):
                batch.sample_rows.append(len(batch.input_ids) - 1)
                batch.sample_states.append(state)
        for state, start, num_tokens in chunks:
            self._add_chunk(batch, state, start, num_tokens)
        return batch

    def _add_chunk(self, batch: _Batch, state: CachedRequestState, start: int, num_tokens: int) -> None:
        first_row = len(batch.input_ids)
        end = start + num_tokens
        batch.input_ids.extend(state.token_ids[start:end])
        batch.positions.extend(range(start, end))
        batch.slots.extend(self.block_table.slots(state.row, start, end))
        batch.prefill_spans.append((state, first_row, num_tokens, start))
        if state.wants_prompt_logprobs:
            # Row of position j predicts token j + 1: rows start .. min(end, prompt - 1) - 1. After a
            # preemption they are scored again; the engine keeps the first score of each position.
            count = min(end, state.num_prompt_tokens - 1) - start
            if count > 0:
                batch.prompt_rows.append((state, first_row, count))
        if end == len(state.token_ids):
            batch.sample_rows.append(first_row + num_tokens - 1)
            batch.sample_states.append(state)

    def _attention_metadata(self, batch: _Batch) -> AttentionMetadata:
        device = self.device
        num_decodes = len(batch.decode_lens)
        tables = lens = None
        table = self.block_table
        inputs = self._inputs
        if num_decodes:
            rows = inputs.put("decode_rows", batch.decode_rows)
            tables = table.gather(rows, max(batch.decode_lens)).to(device)
            lens = inputs.put("decode_lens", batch.decode_lens, device)
        prefills = tuple(
            PrefillChunk(
                query_start=first_row,
                query_len=num_tokens,
                context_len=pos0 + num_tokens,
                block_table=table.blocks(state.row, pos0 + num_tokens).to(device),
            )
            for state, first_row, num_tokens, pos0 in batch.prefill_spans
        )
        metadata = AttentionMetadata(
            slot_mapping=inputs.put("slots", batch.slots, device),
            num_decodes=num_decodes,
            decode_block_tables=tables,
            decode_context_lens=lens,
            prefills=prefills,
        )
        return self.backend.prepare(metadata, self.kv_cache.spec)

    def _sample(self, hidden: torch.Tensor, batch: _Batch) -> ModelRunnerOutput:
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        prompt_lps: dict[str, list[TokenLogprobs]] = {}
        if batch.sample_rows:
            rows = self._inputs.put("sample_rows", batch.sample_rows, hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))  # [num_samples, vocab]
            result = self.sampler(logits, [s.sampling for s in batch.sample_states])
            for i, (state, token_id) in enumerate(zip(batch.sample_states, result.sampled_token_ids)):
                state.token_ids.append(token_id)
                state.sampling.output_token_ids.append(token_id)
                sampled[state.request_id] = [token_id]
                if result.logprobs is not None and result.logprobs[i] is not None:
                    logprobs[state.request_id] = result.logprobs[i]
        for state, first_row, count in batch.prompt_rows:
            pos0 = batch.positions[first_row]
            logits = self.model.compute_logits(hidden[first_row : first_row + count])
            targets = torch.tensor(state.token_ids[pos0 + 1 : pos0 + 1 + count], dtype=torch.int64,
                                   device=hidden.device)
            prompt_lps[state.request_id] = prompt_logprobs(logits, targets, state.sampling.params.prompt_logprobs)
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_lps)


class _HostBuffers:
    """Preallocated int64 host buffers, one per step input, reused every step (grown by doubling).

    `put` copies a step's values in and returns a view of the first len(values)
    entries (moved to `device` when given and not the CPU): valid until the next step.
    """

    def __init__(self, capacity: int = 256):
        self._capacity = capacity
        self._arrays: dict[str, np.ndarray] = {}
        self._tensors: dict[str, torch.Tensor] = {}

    def put(self, name: str, values: list[int], device: Optional[torch.device] = None) -> torch.Tensor:
        count = len(values)
        array = self._arrays.get(name)
        if array is None or array.shape[0] < count:
            size = max(self._capacity, 1 << max(count - 1, 0).bit_length())
            array = self._arrays[name] = np.empty(size, dtype=np.int64)
            self._tensors[name] = torch.from_numpy(array)
        array[:count] = values
        view = self._tensors[name][:count]
        return view if device is None or device.type == "cpu" else view.to(device)
