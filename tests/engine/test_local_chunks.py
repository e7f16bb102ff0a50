"""Chunked local attention's virtual requests (engine/attention/local_chunks.py): a step cut at the chunks'
boundaries, its layout checked by hand, and attention over it equal to masked attention computed from the
definition (a query sees the keys of its own chunk, up to itself)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.kv_cache import KVCache, KVCacheSpec
from engine.attention.layer_attention import LayerAttention
from engine.attention.local_chunks import check_chunk, local_chunks
from engine.attention.step_metadata import step_metadata_for
from engine.attention.torch_backend import TorchAttentionBackend

BLOCK, CHUNK = 4, 16


def _step():
    """A decode at position 34 (blocks 20..28 of its row) and a prompt chunk querying positions 10..39."""
    decode_blocks = list(range(20, 29))
    prompt_blocks = list(range(10))
    slots = torch.tensor([28 * BLOCK + 2, *range(10, 40)])
    return step_metadata_for([(35, 1, decode_blocks), (40, 30, prompt_blocks)], slots, 1, torch.device("cpu"))


def test_a_step_becomes_one_virtual_request_per_chunk_its_queries_reach():
    step = local_chunks(_step(), CHUNK, BLOCK)
    # the decode: chunk 2 (32..47), keys 32..34; the prompt: queries 10..15 | 16..31 | 32..39
    assert step.num_decodes == 1
    assert step.query_start_loc_cpu.tolist() == [0, 1, 7, 23, 31]
    assert step.seq_lens_cpu.tolist() == [3, 16, 16, 8]
    assert step.block_table[:, 0].tolist() == [28, 0, 4, 8]  # each row from its chunk's first block
    assert (step.max_query_len, step.max_seq_len) == (16, 16)
    assert torch.equal(step.slot_mapping, _step().slot_mapping)  # the tokens keep their order


def test_attention_over_the_virtual_requests_is_chunked_attention():
    """The torch backend over the cut step against softmax over each query's own chunk, from the definition."""
    torch.manual_seed(0)
    heads, head_dim = 2, 8
    spec = KVCacheSpec(1, BLOCK, heads, head_dim, torch.float32)
    cache = KVCache(spec, 40, torch.device("cpu"))
    whole = _step()
    backend = TorchAttentionBackend()
    keys = {1: torch.randn(40, heads, head_dim), 0: torch.randn(35, heads, head_dim)}
    values = {1: torch.randn(40, heads, head_dim), 0: torch.randn(35, heads, head_dim)}
    # fill each request's cache from its blocks (the earlier positions), then write this step's K/V
    key_cache, value_cache = cache.layers[0]
    tables = {0: list(range(20, 29)), 1: list(range(10))}
    for request, length in ((0, 35), (1, 40)):
        for position in range(length):
            block, offset = tables[request][position // BLOCK], position % BLOCK
            key_cache[block, offset] = keys[request][position]
            value_cache[block, offset] = values[request][position]
    rows = [(0, 34)] + [(1, p) for p in range(10, 40)]  # (request, position) of each query row
    query = torch.randn(31, heads, head_dim)
    key = torch.stack([keys[request][position] for request, position in rows])  # (this step's, also cached)
    value = torch.stack([values[request][position] for request, position in rows])
    metadata = backend.build_metadata(local_chunks(whole, CHUNK, BLOCK), spec)
    out = backend.attend(query, key, value, key_cache, value_cache, metadata, LayerAttention(head_dim**-0.5))
    for row, (request, position) in enumerate(rows):
        start = position - position % CHUNK
        k, v = keys[request][start : position + 1], values[request][start : position + 1]
        scores = torch.einsum("hd,khd->hk", query[row], k) * head_dim**-0.5
        want = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(out[row].view(heads, head_dim), want, atol=1e-5, rtol=1e-5)


def test_a_block_size_that_does_not_divide_the_chunk_is_refused():
    check_chunk(16, 4)
    with pytest.raises(ValueError, match=r"attention_chunk_size 12\).*--block-size 8 does not"):
        check_chunk(12, 8)
