"""A Gated DeltaNet layer (Qwen3.5's linear attention) over a step's requests, reading and writing their states.

    q | k | v      = silu(causal depthwise conv(in_proj_qkv(x)))   (the conv window carries the last kernel - 1 inputs)
    z              = in_proj_z(x)      beta = sigmoid(in_proj_b(x))      g = -exp(A_log) softplus(in_proj_a(x) + dt_bias)
    q, k           = l2norm(q), l2norm(k); q /= sqrt(d_k)     (each key head read by num_v_heads / num_k_heads value heads)
    S_t            = exp(g_t) S_(t-1);   S_t += k_t ((v_t - S_t^T k_t) beta_t)^T;   o_t = S_t^T q_t        (per head)
    out            = out_proj(rms_norm(o) * silu(z))                (the norm per value head, before the gate)

A prompt's tokens are computed in chunks (the delta rule's WY form: within a chunk a triangular solve and masked
products, between chunks the state passed on), from the state the request's earlier steps left; decodes take one
step of the recurrence each, all of a step's decodes at once. Both in float32, as transformers' reference
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`) computes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from engine.layers.causal_conv import conv_decode, conv_prefill
from engine.layers.recurrent_state import RecurrentStep, StateShape, lone_sequence

CHUNK = 64
"""Tokens per chunk of a prompt's delta rule (transformers' and FLA's)."""


@dataclass(frozen=True, slots=True)
class DeltaNetShape:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def state(self) -> StateShape:
        """The conv window over q, k and v; the state [v_heads, d_k, d_v]."""
        return StateShape(
            2 * self.key_dim + self.value_dim, self.conv_kernel, (self.num_v_heads, self.head_k_dim, self.head_v_dim)
        )


@dataclass(slots=True)
class DeltaNetWeights:
    in_proj: Any  # [2 key_dim + value_dim (q, k, v) + value_dim (z) + 2 v_heads (b, a), hidden], prepared
    conv_weight: torch.Tensor  # [2 key_dim + value_dim, kernel]
    dt_bias: torch.Tensor  # [v_heads] float32
    A: torch.Tensor  # [v_heads] float32: -exp(A_log)
    norm: torch.Tensor  # [head_v_dim]
    out_proj: Any  # [hidden, value_dim]


def delta_net_mix(
    x: torch.Tensor,  # [T, hidden], normed
    weights: DeltaNetWeights,
    shape: DeltaNetShape,
    linear: Callable[..., torch.Tensor],
    step: Optional[RecurrentStep],
    layer: int,  # the layer's index among the model's recurrent layers
) -> torch.Tensor:
    """The layer's output [T, hidden]; `step` None: the rows are one sequence from an empty state, kept nowhere (a
    profiling pass)."""
    conv_dim, value_dim, heads = shape.state.conv_dim, shape.value_dim, shape.num_v_heads
    qkv, z, b, a = linear(x, weights.in_proj, None).split([conv_dim, value_dim, heads, heads], dim=-1)
    beta = torch.sigmoid(b.float())
    g = weights.A * F.softplus(a.float() + weights.dt_bias)  # [T, v_heads]: the log of each token's decay
    if step is None:
        step, layer = lone_sequence(shape.state, x.shape[0], x.dtype, x.device), 0
    conv, states = step.states.conv[layer], step.states.ssm[layer]
    out = torch.empty((x.shape[0], heads, shape.head_v_dim), dtype=torch.float32, device=x.device)
    for first, end, rows in step.decode_slices():
        out[first:end] = _decode(qkv[first:end], g[first:end], beta[first:end], weights, shape, conv, states, rows)
    for first, end, row in step.prefills(layer):
        out[first:end] = _prefill(qkv[first:end], g[first:end], beta[first:end], weights, shape, conv, states, row)
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + shape.norm_eps)
    gated = (weights.norm * normed.to(x.dtype)).float() * F.silu(z.float().reshape(out.shape))
    return linear(gated.to(x.dtype).reshape(x.shape[0], value_dim), weights.out_proj, None)


def _heads(qkv: torch.Tensor, shape: DeltaNetShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [n, v_heads, d_k] (l2-normed, q scaled by d_k^-0.5, each key head repeated for its value heads) and v
    [n, v_heads, d_v], in float32."""
    n = qkv.shape[0]
    q, k, v = qkv.float().split([shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
    per_key = shape.num_v_heads // shape.num_k_heads
    q, k = (_l2norm(t.reshape(n, shape.num_k_heads, shape.head_k_dim)) for t in (q, k))
    q = q * shape.head_k_dim**-0.5
    if per_key > 1:
        q, k = q.repeat_interleave(per_key, dim=1), k.repeat_interleave(per_key, dim=1)
    return q, k, v.reshape(n, shape.num_v_heads, shape.head_v_dim)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _prefill(qkv, g, beta, weights: DeltaNetWeights, shape: DeltaNetShape, conv, states, row: int) -> torch.Tensor:
    """One request's n tokens [n, v_heads, d_v], continuing from (and leaving) its states at `row`."""
    qkv = F.silu(conv_prefill(qkv, weights.conv_weight, None, conv, row))
    q, k, v = _heads(qkv, shape)
    out, final = _chunked_rule(q, k, v, g, beta, states[row])
    states[row] = final
    return out


def _decode(qkv, g, beta, weights: DeltaNetWeights, shape: DeltaNetShape, conv, states, rows) -> torch.Tensor:
    """d requests' next tokens [d, v_heads, d_v]: one step of the conv window and the delta rule each."""
    q, k, v = _heads(F.silu(conv_decode(qkv, weights.conv_weight, None, conv, rows)), shape)
    # (in place on the one copy the gather makes: the state is the step's largest tensor)
    state = states.index_select(0, rows).mul_(torch.exp(g)[:, :, None, None])  # [d, h, d_k, d_v]
    remembered = torch.einsum("dhkv,dhk->dhv", state, k)
    state.addcmul_(k[..., None], ((v - remembered) * beta[..., None])[:, :, None, :])
    states.index_copy_(0, rows, state)
    return torch.einsum("dhkv,dhk->dhv", state, q)


def _chunked_rule(
    q: torch.Tensor,  # [n, h, d_k]
    k: torch.Tensor,  # [n, h, d_k]
    v: torch.Tensor,  # [n, h, d_v]
    g: torch.Tensor,  # [n, h]
    beta: torch.Tensor,  # [n, h]
    initial: torch.Tensor,  # [h, d_k, d_v]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over n tokens in chunks of CHUNK: outputs [n, h, d_v] and the final state [h, d_k, d_v].

    Within a chunk the updates are written as one lower-triangular system (the WY form): with A the masked
    decayed products (beta_i k_i . k_j) and T = (I + A)^-1, the values to write are T (beta v) minus what the
    entering state already predicts (T (beta k decayed) S), and each position reads the entering state and the
    chunk's earlier writes."""
    n = q.shape[0]
    size = min(CHUNK, n)  # (a piece shorter than a chunk is its own chunk: no padding to compute)
    pad = (-n) % size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    count = q.shape[0] // size
    # [h, c, l, d]: heads first, then chunks and positions in a chunk
    q, k, v = (t.reshape(count, size, *t.shape[1:]).permute(2, 0, 1, 3) for t in (q, k, v))
    g, beta = (t.reshape(count, size, -1).permute(2, 0, 1) for t in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    decay = g.cumsum(dim=-1)  # [h, c, l]: log of the decay from the chunk's start through position l
    later = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(later, float("-inf")).exp()  # [h, c, l, s]
    system = (k_beta @ k.transpose(-1, -2)) * between
    scores = (q @ k.transpose(-1, -2)) * between
    eye = torch.eye(size, dtype=q.dtype, device=q.device)
    lower = system.masked_fill(~torch.ones_like(later).tril(-1), 0) + eye  # unit lower-triangular I + A
    values = torch.linalg.solve_triangular(lower, v_beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(lower, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [h, c, 1, 1]
    state = initial
    out = torch.empty_like(values)
    for c in range(count):
        written = values[:, c] - reads[:, c] @ state  # [h, l, d_v]
        out[:, c] = q_decayed[:, c] @ state + scores[:, c] @ written
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ written
    out = out.permute(1, 2, 0, 3).reshape(count * size, *out.shape[:1], out.shape[-1])[:n]
    return out, state
