"""The step as every attention backend sees it: what each backend builds its own metadata from."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

BIDIRECTIONAL_SPANS = "bidirectional spans"
"""What a backend lists in its `attention_features` when its `attend` computes `StepMetadata.bidirectional`; the
runner runs a step that has such spans through the torch backend where its own backend does not."""


def computes_bidirectional_spans(backend: Any) -> bool:
    return BIDIRECTIONAL_SPANS in getattr(backend, "attention_features", ())


def check_causal(step: "StepMetadata", backend_name: str) -> None:
    """RuntimeError for a step with bidirectional ranges reaching a backend that computes causal attention only (the
    runner sends those steps through the torch backend: reaching one here is a bug, never a wrong answer)."""
    if step.bidirectional:
        raise RuntimeError(f"attention backend {backend_name!r} got a step with bidirectional spans; it is causal only")


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """The scheduled tokens of one step, in the runner's persistent buffers (valid for that step only).

    Requests in batch order, decodes (one query token each) first:

        requests  [r0  r1 ... r(D-1) | r(D)     ...  r(R-1)  ]     D = num_decodes, R = num_reqs
        tokens    [ 1   1 ...  1     | q(D)     ...  q(R-1)  ]     q(i) query tokens of request i
        query_start_loc = [0, 1, 2, ..., D, D + q(D), ..., num_tokens]        (cu_seqlens_q)

    Request i's queries are tokens `query_start_loc[i] .. query_start_loc[i + 1] - 1`, at
    positions `seq_lens[i] - q(i) .. seq_lens[i] - 1` of its sequence; its K/V (those
    of this step included, written through `slot_mapping` before attention reads
    them) sit in blocks `block_table[i, : ceil(seq_lens[i] / block_size)]`. One int32
    block table serves the whole batch; entries past a request's blocks are valid
    block ids that nothing reads. The `_cpu` tensors are host copies of the same
    values, for backends that walk the requests in Python without a device sync.

    `bidirectional`: row ranges [first, end) of the step's tokens whose queries also see each other's keys ahead
    of them (an image's tokens in a Gemma 3 prompt: HF's token_type_ids blocks); each lies inside one request's
    prompt chunk. With a sliding window, a query sees keys behind it only within the window, ahead of it every key
    of its range (HF's `(causal or same block) and window`):

        query q, key k of one request:   seen  =  (k <= q  or  q, k in the same range)  and  k > q - window
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32: each request's KV length after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32, on the host
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32, on the host
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    bidirectional: tuple[tuple[int, int], ...] = ()

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def step_metadata_for(
    requests: Sequence[tuple[int, int, Sequence[int]]],
    slot_mapping: torch.Tensor,
    num_decodes: int,
    device: torch.device,
    bidirectional: tuple[tuple[int, int], ...] = (),
) -> StepMetadata:
    """StepMetadata of a step given as (seq_len, query_len, block ids) per request, decodes first (tests and
    profiling steps; the runner writes its own into persistent buffers)."""
    query_lens = [query_len for _, query_len, _ in requests]
    query_start_loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len for seq_len, _, _ in requests], dtype=torch.int32)
    width = max(len(blocks) for _, _, blocks in requests)
    table = torch.zeros((len(requests), width), dtype=torch.int32)
    for i, (_, _, blocks) in enumerate(requests):
        table[i, : len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
    return StepMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_table=table.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        bidirectional=bidirectional,
    )


def single_prefill_metadata(num_tokens: int, block_size: int, device: torch.device) -> StepMetadata:
    """One request prefilling `num_tokens` tokens into blocks 0, 1, ... (a profiling step)."""
    blocks = range(-(-num_tokens // block_size))
    return step_metadata_for([(num_tokens, num_tokens, blocks)], torch.arange(num_tokens), 0, device)


def shared_context_decode_metadata(num_reqs: int, seq_len: int, block_size: int, device: torch.device) -> StepMetadata:
    """`num_reqs` decodes, each at context `seq_len`, all reading blocks 0, 1, ... (a profiling step:
    the attention's working memory is that of distinct requests, the cache only one request's). Every
    request writes its new token at position seq_len - 1."""
    blocks = range(-(-seq_len // block_size))
    slots = torch.full((num_reqs,), seq_len - 1, dtype=torch.int64)
    return step_metadata_for([(seq_len, 1, blocks)] * num_reqs, slots, num_reqs, device)
