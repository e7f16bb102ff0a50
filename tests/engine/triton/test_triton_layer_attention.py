"""The Triton kernels with sliding windows and soft-capped scores against the float64 reference (under Triton's
interpreter on CPU): a mixed step through the prefill kernel, decodes through the split-KV decode kernel with
partitions wholly before a window (which the reduction must skip), and the backend reading a LayerAttention."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.kv_cache import KVCacheSpec  # noqa: E402
from engine.attention.layer_attention import LayerAttention  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.kernels.triton import paged_decode  # noqa: E402
from tests.engine.paged_steps import random_paged_step, reference_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "layer",
    [
        LayerAttention(0.25, sliding_window=6),
        LayerAttention(0.3, softcap=1.5),
        LayerAttention(0.25, sliding_window=3, softcap=2.0),
    ],
    ids=["window", "softcap", "both"],
)
def test_backend_mixed_step(layer):
    """Decodes, a chunk continuing a prefix, a fresh prompt: one varlen prefill-kernel call."""
    step = random_paged_step(
        [(37, 1), (5, 1), (30, 12), (9, 9)],
        2,
        block_size=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_blocks=40,
        device=DEVICE,
    )
    backend = TritonAttentionBackend()
    metadata = backend.build_metadata(step.metadata, KVCacheSpec(1, 4, 2, 16, torch.float32))
    backend.write_kv(step.key, step.value, step.key_cache, step.value_cache, metadata)
    got = backend.attend(step.query, step.key, step.value, step.key_cache, step.value_cache, metadata, layer)
    expected = reference_attention(step, layer.scale, layer.sliding_window, layer.softcap)
    torch.testing.assert_close(got.double().cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [20, 50])
def test_decode_partitions_before_the_window_are_skipped(window):
    """Partitions of 16 tokens: the 70-token request's first partitions hold nothing its query sees."""
    step = random_paged_step(
        [(70, 1), (12, 1)], 2, block_size=8, num_heads=4, num_kv_heads=2, head_dim=16, num_blocks=16, device=DEVICE
    )
    caches = step.key_cache.view(-1, 2, 16), step.value_cache.view(-1, 2, 16)
    caches[0][step.metadata.slot_mapping] = step.key
    caches[1][step.metadata.slot_mapping] = step.value
    got = paged_decode(
        step.query,
        step.key_cache,
        step.value_cache,
        step.metadata.block_table,
        step.metadata.seq_lens,
        0.25,
        partition_size=16,
        window=window,
        softcap=5.0,
    )
    expected = reference_attention(step, 0.25, window, 5.0)
    torch.testing.assert_close(got.double().cpu(), expected, atol=1e-4, rtol=1e-4)
