"""A Mamba-2 layer (state space duality) over a step's requests, reading and writing their recurrent states.

    proj            = in_proj(x)                        -> gate [I] | xBC [I + 2 G N] | dt [heads]
    xBC             = silu(causal depthwise conv(xBC))  (the conv window carries the request's last d_conv - 1 inputs)
    x | B | C       = xBC                               (B and C: one [N] per group of heads)
    dt              = clamp(softplus(dt + dt_bias))     A = -exp(A_log)
    state_t         = exp(dt A) state_(t-1) + dt x_t B_t^T        y_t = state_t C_t + D x_t      (per head)
    out             = out_proj(gated_rms_norm(y, silu(gate)))     (RMS over each group's I / G channels)

A prompt's tokens are scanned in chunks (the SSD form: within a chunk a masked product, between chunks the
states passed on), from the state the request's earlier steps left; decodes take one step of the recurrence
each, all of a step's decodes at once. Both in float32, as HF's reference scan (transformers'
`mamba2_chunk_scan` and `mamba2_selective_state_update`) computes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from engine.layers.causal_conv import conv_decode, conv_prefill
from engine.layers.recurrent_state import MambaShape, RecurrentStep, lone_sequence


@dataclass(slots=True)
class MambaWeights:
    """One layer's mixer: in_proj and out_proj as the model's Linear prepared them, the rest as tensors."""

    in_proj: Any  # [I + conv_dim + heads, hidden]
    in_proj_bias: Optional[torch.Tensor]
    conv_weight: torch.Tensor  # [conv_dim, d_conv]
    conv_bias: Optional[torch.Tensor]  # [conv_dim]
    dt_bias: torch.Tensor  # [heads] float32
    A: torch.Tensor  # [heads] float32: -exp(A_log)
    D: torch.Tensor  # [heads] float32
    norm: torch.Tensor  # [I]
    out_proj: Any  # [hidden, I]
    out_proj_bias: Optional[torch.Tensor]


def mamba_mix(
    x: torch.Tensor,  # [T, hidden], normed
    weights: MambaWeights,
    shape: MambaShape,
    linear: Callable[..., torch.Tensor],  # the model's product: linear(x, weight, bias)
    step: Optional[RecurrentStep],
    layer: int,  # the layer's index among the model's Mamba-2 layers (its states' first axis)
    all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,  # over the ranks (`shape.norm_ranks` > 1)
) -> torch.Tensor:
    """The layer's output [T, hidden] for a step (with several ranks: this rank's heads' partial sum, which the
    caller all-reduces); `step` None: the rows are one sequence from an empty state, kept nowhere (a profiling
    pass)."""
    intermediate, conv_dim = shape.intermediate_size, shape.conv_dim
    proj = linear(x, weights.in_proj, weights.in_proj_bias)
    gate, xbc, dt = proj.split([intermediate, conv_dim, shape.num_heads], dim=-1)
    if step is None:
        step, layer = lone_sequence(shape.state, x.shape[0], x.dtype, x.device), 0
    conv, ssm = step.states.conv[layer], step.states.ssm[layer]
    y = torch.empty((x.shape[0], intermediate), dtype=torch.float32, device=x.device)
    for first, end, rows in step.decode_slices():
        y[first:end] = _decode(xbc[first:end], dt[first:end], weights, shape, conv, ssm, rows)
    for first, end, row in step.prefills(layer):
        y[first:end] = _prefill(xbc[first:end], dt[first:end], weights, shape, conv, ssm, row)
    normed = _gated_norm(y, gate, weights.norm, shape, all_reduce)
    return linear(normed.to(x.dtype), weights.out_proj, weights.out_proj_bias)


def _prefill(
    xbc: torch.Tensor,  # [n, conv_dim]
    dt: torch.Tensor,  # [n, heads]
    weights: MambaWeights,
    shape: MambaShape,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    row: int,
) -> torch.Tensor:
    """One request's n tokens [n, I] float32, continuing from (and leaving) its states at `row`."""
    n = xbc.shape[0]
    xbc = F.silu(conv_prefill(xbc, weights.conv_weight, weights.conv_bias, conv_states, row))  # [n, conv_dim]
    x, B, C = _split(xbc, shape, n)
    y, final = _chunk_scan(x, _time_steps(dt, weights, shape), weights.A, B, C, ssm_states[row], shape.chunk_size)
    ssm_states[row] = final
    return (y + weights.D[:, None] * x).reshape(n, -1)


def _decode(
    xbc: torch.Tensor,  # [d, conv_dim]: one token per request
    dt: torch.Tensor,  # [d, heads]
    weights: MambaWeights,
    shape: MambaShape,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    rows: torch.Tensor,  # [d]
) -> torch.Tensor:
    """d requests' next tokens [d, I] float32: one step of the conv window and the recurrence each."""
    d = xbc.shape[0]
    convolved = conv_decode(xbc, weights.conv_weight, weights.conv_bias, conv_states, rows)
    x, B, C = _split(F.silu(convolved), shape, d)  # [d, heads, head_dim], [d, heads, N] x 2
    # (not clamped to time_step_limit: transformers' and vLLM's single-step updates take dt as softplus gives it;
    # only their chunked scans clamp, as `_prefill` does)
    dt = F.softplus(dt.float() + weights.dt_bias)  # [d, heads]
    decay = torch.exp(dt * weights.A)  # [d, heads]
    # (in place on the one copy the gather makes: the state is the step's largest tensor)
    state = ssm_states.index_select(0, rows).mul_(decay[:, :, None, None])
    state.addcmul_((dt[:, :, None] * x)[..., None], B[:, :, None, :])
    ssm_states.index_copy_(0, rows, state)
    y = torch.einsum("dhpn,dhn->dhp", state, C) + weights.D[:, None] * x
    return y.reshape(d, -1)


def _split(xbc: torch.Tensor, shape: MambaShape, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, heads, head_dim], and B, C [n, heads, N] (each group's repeated for its heads), in float32."""
    heads, group_width = shape.num_heads, shape.num_groups * shape.state_size
    x, B, C = xbc.float().split([shape.intermediate_size, group_width, group_width], dim=-1)
    per_group = heads // shape.num_groups
    B = B.reshape(n, shape.num_groups, shape.state_size).repeat_interleave(per_group, dim=1)
    C = C.reshape(n, shape.num_groups, shape.state_size).repeat_interleave(per_group, dim=1)
    return x.reshape(n, heads, shape.head_dim), B, C


def _time_steps(dt: torch.Tensor, weights: MambaWeights, shape: MambaShape) -> torch.Tensor:
    low, high = shape.time_step_limit
    return F.softplus(dt.float() + weights.dt_bias).clamp(min=low, max=high)


def _chunk_scan(
    x: torch.Tensor,  # [n, heads, head_dim]
    dt: torch.Tensor,  # [n, heads]
    A: torch.Tensor,  # [heads]
    B: torch.Tensor,  # [n, heads, N]
    C: torch.Tensor,  # [n, heads, N]
    initial: torch.Tensor,  # [heads, head_dim, N]
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over n tokens in chunks of `chunk`: outputs [n, heads, head_dim] (without D's skip) and the
    final state [heads, head_dim, N]. Within a chunk, y_l = sum_{s <= l} (C_l . B_s) exp(sum_{s < j <= l} a_j)
    dt_s x_s (a = dt A); each chunk also reads the state entering it, decayed to each position."""
    n = x.shape[0]
    chunk = min(chunk, n)  # (a piece shorter than a chunk is its own chunk: no padding to compute)
    pad = (-n) % chunk
    if pad:
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, B, C))
    count = x.shape[0] // chunk
    xs = (x * dt[..., None]).reshape(count, chunk, *x.shape[1:])  # [c, l, h, p]
    a = (dt * A).reshape(count, chunk, -1).permute(0, 2, 1)  # [c, h, l]
    B = B.reshape(count, chunk, *B.shape[1:])
    C = C.reshape(count, chunk, *C.shape[1:])
    cumulative = torch.cumsum(a, dim=-1)  # [c, h, l]
    decay_within = torch.exp(_segment_sums(a))  # [c, h, l, s]
    scores = torch.einsum("clhn,cshn->chls", C, B) * decay_within
    y = torch.einsum("chls,cshp->clhp", scores, xs)
    # each chunk's own contribution to the state leaving it, then the states entering each chunk
    to_end = torch.exp(cumulative[..., -1:] - cumulative)  # [c, h, l]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", B, to_end, xs)
    states = torch.cat([initial[None], chunk_states], dim=0)  # [c + 1, h, p, n]
    decay_between = torch.exp(_segment_sums(F.pad(cumulative[..., -1].t(), (1, 0))))  # [h, c + 1, c + 1]
    entering = torch.einsum("hzs,shpn->zhpn", decay_between, states)  # [c + 1, h, p, n]
    y = y + torch.einsum("clhn,chpn,chl->clhp", C, entering[:-1], torch.exp(cumulative))
    return y.reshape(count * chunk, *x.shape[1:])[:n], entering[-1]


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """[..., l, s]: sum of a[s + 1 .. l] for s <= l, -inf above the diagonal (exp of it: 0), from masked cumulative
    sums (no differences of large sums)."""
    length = a.shape[-1]
    expanded = a[..., None].expand(*a.shape, length)  # [..., j, s] = a[j]
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(expanded.masked_fill(~below, 0), dim=-2)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~causal, float("-inf"))


def _gated_norm(
    y: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    shape: MambaShape,
    all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]],
) -> torch.Tensor:
    """RMSNorm of y * silu(gate) over each group's channels, times the weight, in float32 (a group that spans the
    ranks: the sum of squares over every rank's channels)."""
    gated = y * F.silu(gate.float())
    groups = gated.reshape(gated.shape[0], shape.num_groups, -1)
    if shape.norm_ranks > 1:
        assert all_reduce is not None  # (the model passes its group's whenever it holds a share)
        mean = all_reduce(groups.pow(2).sum(-1, keepdim=True)) / (groups.shape[-1] * shape.norm_ranks)
    else:
        mean = groups.pow(2).mean(-1, keepdim=True)
    normed = groups * torch.rsqrt(mean + shape.norm_eps)
    return weight.float() * normed.reshape(gated.shape)
