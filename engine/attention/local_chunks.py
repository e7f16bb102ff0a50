"""Chunked local attention (Llama 4's `attention_chunk_size` C on its RoPE layers) as plain causal attention over
"virtual requests", so that every backend computes it unchanged (vLLM's local-attention virtual batches).

A query at position p sees the keys at positions [floor(p / C) * C, p]: those of its own chunk. A request whose
step queries positions [s - q, s) is cut at the chunk boundaries into virtual requests, one per chunk the queries
reach; the one of chunk c queries its part of the range and its keys are positions [c C, min(s, (c + 1) C)):

    positions       0 ........ C-1 | C ........ 2C-1 | 2C ..... s-1
    queries                     [===|=================|=========]        (one request, q tokens)
    virtual requests            [r0]|[       r1      ]|[   r2   ]
    r1's keys                       |C ........ 2C-1 |                  (its block-table row starts at C / block)

Each virtual request's block-table row is its request's row from block c C / block_size on (so C must be a
multiple of the block size), its length min(s, (c + 1) C) - c C; the tokens keep their order, so the slot mapping
(the K/V written this step) is the step's own. A decode (one query) is one virtual decode: decodes stay first.
"""

from __future__ import annotations

import torch

from engine.attention.step_metadata import StepMetadata


def check_chunk(chunk: int, block_size: int) -> None:
    """ValueError unless the chunk starts every virtual request at a block boundary."""
    if chunk % block_size:
        raise ValueError(
            f"chunked attention (attention_chunk_size {chunk}) needs a block size that divides it; "
            f"--block-size {block_size} does not"
        )


def local_chunks(step: StepMetadata, chunk: int, block_size: int) -> StepMetadata:
    """`step` as the virtual requests of its queries' chunks (see the module docstring)."""
    if not step.num_reqs:
        return step
    if step.bidirectional:  # (Llama 4 is served as a text model: no image spans reach it)
        raise RuntimeError("chunked local attention got a step with bidirectional spans")
    seq_lens = step.seq_lens_cpu.tolist()
    starts = step.query_start_loc_cpu.tolist()
    requests: list[int] = []  # each virtual request's request
    query_starts = [0]
    lengths: list[int] = []  # each virtual request's keys: its chunk's, up to its last query
    first_blocks: list[int] = []
    for i in range(step.num_reqs):
        end = seq_lens[i]
        position = end - (starts[i + 1] - starts[i])
        while position < end:
            chunk_start = position - position % chunk
            stop = min(end, chunk_start + chunk)
            requests.append(i)
            query_starts.append(query_starts[-1] + stop - position)
            lengths.append(stop - chunk_start)
            first_blocks.append(chunk_start // block_size)
            position = stop
    device = step.block_table.device
    max_blocks = step.block_table.shape[1]
    width = min(max_blocks, -(-max(lengths) // block_size))
    columns = torch.tensor(first_blocks, dtype=torch.int64)[:, None] + torch.arange(width)[None, :]
    columns.clamp_(max=max_blocks - 1)  # (past a row's blocks: valid ids nothing reads)
    rows = torch.tensor(requests, dtype=torch.int64)
    table = step.block_table[rows.to(device)].gather(1, columns.to(device)).contiguous()
    query_start_loc_cpu = torch.tensor(query_starts, dtype=torch.int32)
    seq_lens_cpu = torch.tensor(lengths, dtype=torch.int32)
    return StepMetadata(
        slot_mapping=step.slot_mapping,
        query_start_loc=query_start_loc_cpu.to(device),
        seq_lens=seq_lens_cpu.to(device),
        block_table=table,
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens_cpu=seq_lens_cpu,
        num_decodes=step.num_decodes,
        max_query_len=max(b - a for a, b in zip(query_starts, query_starts[1:])),
        max_seq_len=max(lengths),
    )
