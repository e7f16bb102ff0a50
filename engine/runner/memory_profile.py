"""Sizing the KV cache on CUDA from `gpu_memory_utilization` after profiling a forward pass at max batch.

    requested   = total device memory x gpu_memory_utilization
    non-KV      = torch allocations after loading (the weights)
                + peak activation memory of one profiled step at the token budget, its
                  logits and their sampling (worst case: top-p, penalties, logprobs)
                + memory held outside torch's allocator (CUDA context, other processes)
    KV budget   = requested - non-KV

Two steps are profiled, and the larger peak kept: the largest prefill the scheduler
can form (`max_num_batched_tokens` query tokens, as one request over a throwaway
cache, logits for `max_num_seqs` rows) and the largest decode (`max_num_seqs`
requests at `max_model_len`, all reading one throwaway request's blocks), since a
backend's decode may need more working memory than its prefill (the torch backend
gathers every decode's K/V into a padded copy).
"""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend
from engine.attention.step_metadata import StepMetadata, shared_context_decode_metadata, single_prefill_metadata
from engine.models.llama import LlamaForCausalLM
from engine.attention.kv_cache import KVCache, KVCacheSpec
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Sampler
from engine.sampling.state import SamplingState


def profile_peak_bytes(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    spec: KVCacheSpec,
    max_num_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    device: torch.device,
) -> int:
    """The larger activation peak of the largest prefill step and the largest decode step."""
    prefill = single_prefill_metadata(max_num_tokens, spec.block_size, device)
    decode = shared_context_decode_metadata(max_num_seqs, max_model_len, spec.block_size, device)
    return max(
        profile_step_peak_bytes(model, backend, spec, prefill, max_num_seqs, max_model_len, device),
        profile_step_peak_bytes(model, backend, spec, decode, max_num_seqs, max_model_len, device),
    )


def profile_step_peak_bytes(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    spec: KVCacheSpec,
    step: StepMetadata,
    num_logit_rows: int,
    max_model_len: int,
    device: torch.device,
) -> int:
    """Peak memory allocated above the current allocation while `step` runs over a throwaway cache.

    Positions wrap at max_model_len (a step may hold more tokens than one sequence can)."""
    num_blocks = -(-step.max_seq_len // spec.block_size)
    scratch = KVCache(spec, num_blocks, device)
    num_tokens = step.num_tokens
    positions = torch.arange(num_tokens, device=device) % max_model_len
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    metadata = backend.build_metadata(step, spec)  # counted: real steps build theirs every step
    stage = model.stage  # a pipeline stage after the first starts from hidden states and computes no logits
    arrived = None
    if not stage.is_first:
        arrived = torch.zeros(num_tokens, model.arch.hidden_size, dtype=model.dtype, device=device)
    layers_metadata = [metadata] * spec.num_layers
    if arrived is None:
        hidden = model.forward(input_ids, positions, scratch.layers, layers_metadata, backend)
    else:
        hidden = model.forward(input_ids, positions, scratch.layers, layers_metadata, backend, arrived)
    if stage.is_first and model.lm_head is not None:  # (a pooling model has none: it computes no logits)
        logits = model.compute_logits(hidden[: min(num_logit_rows, num_tokens)])
        Sampler()(logits, worst_case_sampling_states(logits.shape[0], device))
        del logits
    del hidden, arrived
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del scratch
    torch.cuda.empty_cache()
    return peak  # activations only: the scratch cache was allocated before `before`


def worst_case_sampling_states(num_rows: int, device: torch.device) -> list[SamplingState]:
    """Rows that take the sampler's most memory-hungry way on a GPU: top-p without top-k (a sort of the
    whole vocabulary), every penalty (dense occurrence tables), logprobs (ranks over whole rows)."""
    params = SamplingParams(
        temperature=0.8, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1, logprobs=20
    )
    return [
        SamplingState.create(params, list(range(64)), list(range(64)), frozenset(), device) for _ in range(num_rows)
    ]


def cuda_kv_budget(utilization: float, step_peak_bytes: int, device: torch.device) -> int:
    """Bytes left for the KV cache once weights, the profiled step and non-torch memory are set aside."""
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    non_kv = torch.cuda.memory_allocated(device) + step_peak_bytes + max(outside_torch, 0)
    return int(total * utilization) - non_kv
