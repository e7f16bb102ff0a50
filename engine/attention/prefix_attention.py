"""A prompt chunk that continues a cached prefix, as two mask-free flash calls merged by their log-sum-exps.

    keys      [ prefix (cached, P tokens) | the chunk's own (Q tokens) ]
    queries   every query sees the whole prefix, and its own chunk causally:

              out_p, lse_p = flash(q, K[:P], V[:P])                 (no mask: every pair counts)
              out_c, lse_c = flash(q, K[P:], V[P:], is_causal)      (square: the causal diagonal is exact)
              out = out_p * e^(lse_p - lse) + out_c * e^(lse_c - lse),   lse = logaddexp(lse_p, lse_c)

One SDPA call with a boolean [Q, P + Q] mask scores every (query, key) pair, the masked half of the chunk's
own square too, and the mask itself is built per layer: on CPU that call ran at about half the FLOP rate of
these two (a 2048-token chunk over a 2048-token prefix, bf16, 1 thread: 105 vs 220 GFLOP/s; docs/performance.md,
"Long prompts"). torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) returns the
log-sum-exp beside the output and reads grouped K/V heads in place (GQA).
"""

from __future__ import annotations

import torch

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def prefix_and_chunk_attention(
    query: torch.Tensor,  # [1, heads, Q, head_dim]
    chunk_key: torch.Tensor,  # [1, kv_heads, Q, head_dim]: the chunk's own keys
    chunk_value: torch.Tensor,
    prefix_key: torch.Tensor,  # [1, kv_heads, P, head_dim]: the cached prefix's keys
    prefix_value: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [1, heads, Q, head_dim] in the query's dtype
    """Causal attention of a chunk at positions [P, P + Q) over its prefix and itself (CPU, float32/bfloat16)."""
    out_p, lse_p = _FLASH(query, prefix_key, prefix_value, scale=scale)
    out_c, lse_c = _FLASH(query, chunk_key, chunk_value, is_causal=True, scale=scale)
    lse = torch.logaddexp(lse_p, lse_c)  # [1, heads, Q] float32
    weight_p = torch.exp(lse_p - lse).unsqueeze(-1)  # [1, heads, Q, 1]
    merged = out_p.float().mul_(weight_p).add_(out_c.float().mul_(1.0 - weight_p))
    return merged.to(query.dtype)
