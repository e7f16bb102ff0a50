"""The batch-invariant CPU backend: every query token, prompt or decode, through the paged decode kernel.

A query's attention must not depend on what else is in the step. The default backends
run a prompt chunk through SDPA, whose blocking (and so its reduction order) depends on
the chunk's length and on whether it continues a cached prefix, both of which depend on
the other requests (chunked prefill splits a prompt by the budget the others leave;
prefix-cache hits depend on what ran before). Here every query token is a row of its
own: the kernel of csrc/paged_decode.cpp reads the request's K/V from the paged cache in
place, block by block in a fixed order, up to and including the token's own position.

    tokens   [d0 d1 | p0 p0 p0 | p1 p1]          (decodes first, then prefill chunks)
    rows     [d0 d1 | p0@s p0@s+1 p0@s+2 | ...]   one row each, context = its position + 1

The cost: prompt attention re-reads the cached K/V once per query token instead of once
per query tile (the kernel is the decode one); decodes cost what they cost with `cpu`.
"""

from __future__ import annotations

import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.layer_attention import FEATURES, SINKS
from engine.attention.metadata import AttentionMetadata
from engine.attention.step_metadata import StepMetadata, check_causal
from engine.attention.kv_cache import KVCacheSpec


class BatchInvariantCpuBackend(CpuAttentionBackend):
    """`cpu` with prompt chunks turned into single-query rows when the step's metadata is built."""

    name = "cpu-batch-invariant"
    cuda_graphs = False  # CPU only
    split_sequences = False  # a split sums a row's keys in parts whose number depends on the batch and threads
    # (no bidirectional spans: a row's keys end at its own position; the torch path they would need is not
    # batch-invariant, so such a model's images are refused in this mode at start-up)
    attention_features = (*FEATURES, SINKS)

    def build_metadata(self, step: StepMetadata, spec: KVCacheSpec) -> AttentionMetadata:
        check_causal(step, self.name)
        if step.num_decodes == step.num_reqs:
            return super().build_metadata(step, spec)
        num_tokens = step.num_tokens
        device = step.slot_mapping.device
        starts = step.query_start_loc_cpu
        query_lens = (starts[1:] - starts[:-1]).to(device=device, dtype=torch.int64)  # [num_reqs]
        # token t of request i (at position seq_lens[i] - q(i) + j): its request's table row, context j + 1 + ...
        width = -(-step.max_seq_len // spec.block_size)
        tables = step.block_table[:, :width].repeat_interleave(query_lens, dim=0).contiguous()  # [num_tokens, width]
        request_of_token = torch.repeat_interleave(torch.arange(step.num_reqs, device=device), query_lens)
        first_position = (step.seq_lens.to(torch.int64) - query_lens)[request_of_token]  # [num_tokens]
        offset_in_request = (
            torch.arange(num_tokens, device=device) - starts[:-1].to(device=device, dtype=torch.int64)[request_of_token]
        )
        lens = (first_position + offset_in_request + 1).to(torch.int32)  # [num_tokens]
        return AttentionMetadata(step.slot_mapping, num_tokens, tables, lens, ())
