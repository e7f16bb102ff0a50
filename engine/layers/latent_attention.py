"""Multi-head latent attention (DeepSeek-V2/V3) over a latent KV cache, in its absorbed form.

    a      = x @ [W_q (or W_qa) | W_kva]^T                 one product: [T, q rows + kv_lora_rank + rope]
    q      = W_q x, or W_qb rms_norm(W_qa x)                 [T, H, nope + rope] = [q_nope | q_pe]
    c_kv   = rms_norm(a's kv_lora_rank part)                 [T, kv_lora_rank]: the latent
    k_pe   = a's rope part                                   [T, rope]: one rotated key for every head
    cache  <- [c_kv | rope(k_pe)]                            kv_lora_rank + rope values per token and layer

HF expands the latent into heads (k_nope = W_UK c_kv, v = W_UV c_kv, with kv_b_proj = [W_UK | W_UV] per head).
Here the products are absorbed instead (as vLLM and SGLang do), so attention reads the cache as it is:

    q_nope . k_nope = (W_UK^T q_nope) . c_kv   ->   query = [W_UK^T q_nope | rope(q_pe)]  [T, H, kv_lora_rank + rope]
    p . v           = W_UV (p . c_kv)          ->   out   = W_UV (attention over the entries, values = c_kv)

one KV head of width kv_lora_rank + rope whose values are its first kv_lora_rank features (LayerAttention's
`latent_rank`), then W_UV per head and o_proj.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.layer_attention import LayerAttention
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.layers.rotary import RotaryEmbedding

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: HF builds them with RMSNorm's default eps


@dataclass(slots=True)
class LatentAttentionWeights:
    qkv_a: torch.Tensor  # [q rows + kv_lora_rank + rope, hidden]: q_proj (or q_a_proj) | kv_a_proj_with_mqa
    qkv_a_bias: Optional[torch.Tensor]
    q_a_norm: Optional[torch.Tensor]  # [q_lora_rank]; None: q comes straight from q_proj
    q_b: Optional[torch.Tensor]  # [H * (nope + rope), q_lora_rank]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    w_uk: torch.Tensor  # [H, nope, kv_lora_rank]: kv_b_proj's key rows per head
    w_uv: torch.Tensor  # [H, kv_lora_rank, v_head_dim]: its value rows per head, transposed
    o_proj: torch.Tensor  # [hidden, H * v_head_dim]
    o_bias: Optional[torch.Tensor]

    def matrices(self) -> list:
        return [m for m in (self.qkv_a, self.q_b, self.w_uk, self.w_uv, self.o_proj) if m is not None]


def split_kv_b(kv_b: torch.Tensor, num_heads: int, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [H * (nope + v), kv_lora_rank] -> (W_UK [H, nope, rank], W_UV^T [H, rank, v])."""
    per_head = kv_b.view(num_heads, -1, kv_b.shape[1])
    return per_head[:, :nope].contiguous(), per_head[:, nope:].transpose(1, 2).contiguous()


def latent_attention(
    weights: LatentAttentionWeights,
    x: torch.Tensor,
    angles,
    rotary: RotaryEmbedding,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    backend: AttentionBackend,
    layer: LayerAttention,
    linear: Linear,
    ops: TorchLayerOps,
) -> torch.Tensor:
    """x [T, hidden] (normed) -> [T, hidden]; writes the step's latent entries into the cache first."""
    num_tokens = x.shape[0]
    num_heads, nope, rank = weights.w_uk.shape
    a = linear(x, weights.qkv_a, weights.qkv_a_bias)  # [T, q rows + rank + rope]
    q_rows = a.shape[1] - rank - rotary.cos.shape[-1]
    q = a[:, :q_rows]
    if weights.q_b is not None and weights.q_a_norm is not None:  # q_lora_rank: both, else neither
        q = linear(ops.rms_norm(q.contiguous(), weights.q_a_norm, LATENT_NORM_EPS), weights.q_b, None)
    q = q.view(num_tokens, num_heads, -1)  # [T, H, nope + rope]
    c_kv = ops.rms_norm(a[:, q_rows : q_rows + rank].contiguous(), weights.kv_a_norm, LATENT_NORM_EPS)
    # q_pe of every head and the one k_pe, rotated together: [T, H + 1, rope]
    pe = ops.rotary(torch.cat([q[:, :, nope:], a[:, None, q_rows + rank :]], dim=1), angles, rotary)
    q_latent = torch.bmm(q[:, :, :nope].transpose(0, 1), weights.w_uk).transpose(0, 1)  # [T, H, rank]
    query = torch.cat([q_latent, pe[:, :num_heads]], dim=-1)  # [T, H, rank + rope]
    entries = torch.cat([c_kv[:, None], pe[:, num_heads:]], dim=-1)  # [T, 1, rank + rope]
    values = entries[..., :rank]
    backend.write_kv(entries, values, key_cache, value_cache, metadata)
    out = backend.attend(query, entries, values, key_cache, value_cache, metadata, layer)  # [T, H, rank]
    out = torch.bmm(out.transpose(0, 1), weights.w_uv).transpose(0, 1)  # [T, H, v]
    return linear(out.reshape(num_tokens, -1), weights.o_proj, weights.o_bias)
