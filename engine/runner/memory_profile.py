"""Sizing the KV cache on CUDA from `gpu_memory_utilization` after profiling a forward pass at max batch.

    requested   = total device memory x gpu_memory_utilization
    non-KV      = torch allocations after loading (the weights)
                + peak activation memory of one profiled step at the token budget
                + memory held outside torch's allocator (CUDA context, other processes)
    KV budget   = requested - non-KV

The profiled step is the largest the scheduler can form: `max_num_batched_tokens`
query tokens (as one prefill over a throwaway cache) and logits for `max_num_seqs`
rows, so the real steps never need more activation memory than was set aside.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, AttentionMetadata, PrefillChunk
from engine.runner.kv_cache import KVCache, KVCacheSpec
from engine.models.llama import LlamaForCausalLM


def profile_step_peak_bytes(model: LlamaForCausalLM, backend: AttentionBackend, spec: KVCacheSpec,
                            num_tokens: int, num_logit_rows: int, max_model_len: int, device: torch.device) -> int:
    """Peak memory allocated above the current allocation while one step of `num_tokens` runs.

    Positions wrap at max_model_len (a step may hold more tokens than one sequence can)."""
    num_blocks = -(-num_tokens // spec.block_size)
    scratch = KVCache(spec, num_blocks, device)
    slots = torch.arange(num_tokens, device=device)
    positions = slots % max_model_len
    metadata = AttentionMetadata(
        slot_mapping=slots,
        num_decodes=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=(PrefillChunk(0, num_tokens, num_tokens, torch.arange(num_blocks, device=device)),),
    )
    metadata = backend.prepare(metadata, spec)
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = model.forward(input_ids, positions, scratch.layers, metadata, backend)
    model.compute_logits(hidden[: min(num_logit_rows, num_tokens)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del scratch, hidden
    torch.cuda.empty_cache()
    return peak  # activations only: the scratch cache was allocated before `before`


def cuda_kv_budget(utilization: float, step_peak_bytes: int, device: torch.device) -> int:
    """Bytes left for the KV cache once weights, the profiled step and non-torch memory are set aside."""
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    non_kv = torch.cuda.memory_allocated(device) + step_peak_bytes + max(outside_torch, 0)
    return int(total * utilization) - non_kv
