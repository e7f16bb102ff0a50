"""The two-call prefix + chunk attention (engine/attention/prefix_attention.py) against float64 softmax attention,
in float32 (AVX2-class machines' dtype) and bfloat16 (the AVX-512 BF16 / AMX one), with grouped KV heads."""

from __future__ import annotations

import pytest
import torch

from engine.attention.prefix_attention import prefix_and_chunk_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference(q, k, v, prefix: int, scale: float) -> torch.Tensor:
    """Causal attention in float64 of queries at positions [prefix, prefix + Q) over keys [0, prefix + Q)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    query_pos = torch.arange(prefix, prefix + q.shape[2])[:, None]
    visible = torch.arange(k.shape[2])[None, :] <= query_pos
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=str)
@pytest.mark.parametrize("prefix,chunk", [(1, 1), (1, 37), (300, 1), (300, 129), (17, 512)])
def test_matches_float64_reference(dtype, tolerance, prefix, chunk):
    gen = torch.Generator().manual_seed(prefix * 1000 + chunk)
    heads, kv_heads, head_dim = 6, 2, 64
    q = torch.randn(1, heads, chunk, head_dim, generator=gen)
    k = torch.randn(1, kv_heads, prefix + chunk, head_dim, generator=gen) * 2  # peaked softmaxes
    v = torch.randn(1, kv_heads, prefix + chunk, head_dim, generator=gen)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = head_dim**-0.5
    got = prefix_and_chunk_attention(q, k[:, :, prefix:], v[:, :, prefix:], k[:, :, :prefix], v[:, :, :prefix], scale)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), reference(q, k, v, prefix, scale), atol=tolerance, rtol=tolerance)
