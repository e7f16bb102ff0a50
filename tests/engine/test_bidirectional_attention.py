"""A prompt chunk with bidirectional row ranges (an image of Gemma 3): the torch and cpu backends against a dense
reference of HF's mask, `(key <= query or both in the range) and key > query - window`, over a cached prefix."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

from engine.attention.backend import get_attention_backend
from engine.attention.kv_cache import KVCacheSpec
from engine.attention.layer_attention import LayerAttention
from engine.attention.metadata import decode_and_chunks
from engine.attention.step_metadata import check_causal, step_metadata_for
from engine.errors import SettingsConflictError

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 16
PREFIX, QUERIES = 5, 11  # the chunk: positions 5 .. 15, over 5 cached ones
SPAN = (3, 9)  # the chunk's rows 3 .. 8 (positions 8 .. 13) see each other both ways


def reference(query, keys, values, layer: LayerAttention) -> torch.Tensor:
    """[queries, heads, head_dim] from the whole sequence's keys and values, HF's mask spelled out."""
    query_pos = torch.arange(PREFIX, PREFIX + QUERIES)[:, None]
    key_pos = torch.arange(PREFIX + QUERIES)[None, :]
    in_span = (query_pos >= PREFIX + SPAN[0]) & (query_pos < PREFIX + SPAN[1])
    key_in_span = (key_pos >= PREFIX + SPAN[0]) & (key_pos < PREFIX + SPAN[1])
    mask = (key_pos <= query_pos) | (in_span & key_in_span)
    if layer.sliding_window is not None:
        mask &= key_pos > query_pos - layer.sliding_window
    group = HEADS // KV_HEADS
    k, v = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)  # [len, heads, dim]
    scores = torch.einsum("qhd,khd->hqk", query, k) * layer.scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def run_chunk(backend, layer: LayerAttention, bidirectional=((PREFIX + SPAN[0], PREFIX + SPAN[1]),)):
    torch.manual_seed(0)
    total = PREFIX + QUERIES
    keys, values = torch.randn(total, KV_HEADS, HEAD_DIM), torch.randn(total, KV_HEADS, HEAD_DIM)
    query = torch.randn(QUERIES, HEADS, HEAD_DIM)
    num_blocks = -(-total // BLOCK_SIZE)
    blocks = list(range(num_blocks))[::-1]  # (not in order: the table is read)
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(total)])
    key_cache.view(-1, KV_HEADS, HEAD_DIM)[slots[:PREFIX]] = keys[:PREFIX]  # the cached prefix
    value_cache.view(-1, KV_HEADS, HEAD_DIM)[slots[:PREFIX]] = values[:PREFIX]
    # (a decode row first, as the runner lays a step out: the ranges count the step's rows)
    step = step_metadata_for(
        [(1, 1, [0]), (total, QUERIES, blocks)],
        torch.cat([torch.tensor([0]), slots[PREFIX:]]),
        1,
        torch.device("cpu"),
        bidirectional=tuple((1 + lo - PREFIX, 1 + hi - PREFIX) for lo, hi in bidirectional),
    )
    spec = KVCacheSpec(
        num_layers=1, block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32
    )
    metadata = backend.build_metadata(step, spec)
    chunk_query = torch.cat([torch.randn(1, HEADS, HEAD_DIM), query])
    chunk_keys = torch.cat([torch.randn(1, KV_HEADS, HEAD_DIM), keys[PREFIX:]])
    chunk_values = torch.cat([torch.randn(1, KV_HEADS, HEAD_DIM), values[PREFIX:]])
    backend.write_kv(chunk_keys, chunk_values, key_cache, value_cache, metadata)
    out = backend.attend(chunk_query, chunk_keys, chunk_values, key_cache, value_cache, metadata, layer)
    return out[1:], reference(query, keys, values, layer)


def backend_named(name: str):
    try:
        return get_attention_backend(name, torch.device("cpu"), torch.float32)
    except SettingsConflictError as error:  # (the cpu backend's kernels did not build here)
        pytest.skip(str(error))


@pytest.mark.parametrize("name", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 4])
def test_a_chunk_with_a_bidirectional_range_matches_the_dense_mask(name, window: Optional[int]):
    layer = LayerAttention(scale=HEAD_DIM**-0.5, sliding_window=window)
    served, expected = run_chunk(backend_named(name), layer)
    torch.testing.assert_close(served, expected, atol=1e-5, rtol=1e-5)
    causal, _ = run_chunk(backend_named(name), layer, bidirectional=())
    assert not torch.allclose(causal, expected, atol=1e-3)  # (the range changes the answer)


def test_the_ranges_reach_their_chunks():
    step = step_metadata_for(
        [(5, 1, [0, 1]), (9, 6, [2, 3, 4]), (4, 4, [5])], torch.arange(11), 1, torch.device("cpu"), ((2, 5), (7, 10))
    )
    first, second = decode_and_chunks(step, BLOCK_SIZE).prefills
    assert first.bidirectional == ((1, 4),) and second.bidirectional == ((0, 3),)


def test_a_causal_only_backend_refuses_a_step_with_ranges():
    step = step_metadata_for([(4, 4, [0])], torch.arange(4), 0, torch.device("cpu"), ((0, 3),))
    with pytest.raises(RuntimeError, match="causal only"):
        check_causal(step, "flash")
    check_causal(dataclasses.replace(step, bidirectional=()), "flash")
