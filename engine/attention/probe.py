"""One tiny paged step through an attention backend, checked against a float32 reference.

A library's signature says what it accepts, not what its kernels run: flash-attn 4 before
4.0.0b5 asserts "paged KV not supported on SM 9.0", SM 12.x still asserts, and SM 9.0 paging
refuses some head dims. So a backend is chosen only after it has run the exact configuration
the engine will give it (dtype, heads, head dim, block size) on the device, once, at start-up:

    request 0  decode   seq_len block_size + 2   blocks [2, 0]   (a partial last block, out of order)
    request 1  prefill  3 tokens                 block  [1]

Values are random (standard deviation 0.5, so outputs stay below 2 in magnitude and a
half-precision step is at most 2**-7); a kernel that runs but answers wrongly is refused too.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from engine.attention.attention_shape import AttentionShape
from engine.attention.step_metadata import StepMetadata, step_metadata_for
from engine.runner.kv_cache import KVCacheSpec

PROBE_MAX_ABS_ERROR = 2e-2
PROBE_BLOCKS = ([2, 0], [1])


class ProbeStep(NamedTuple):
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: this step's new K
    value: torch.Tensor
    key_cache: torch.Tensor  # [4, block_size, num_kv_heads, head_dim], earlier tokens already written
    value_cache: torch.Tensor
    metadata: StepMetadata
    spec: KVCacheSpec


def probe_step(shape: AttentionShape, block_size: int, dtype: torch.dtype, device: torch.device) -> ProbeStep:
    """The probe's inputs on `device` (drawn on the CPU from a fixed seed)."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = shape

    def randn(*size: int) -> torch.Tensor:
        return (0.5 * torch.randn(*size, generator=generator)).to(dtype=dtype, device=device)

    decode_len = block_size + 2
    requests = [(decode_len, 1, PROBE_BLOCKS[0]), (3, 3, PROBE_BLOCKS[1])]
    positions = [(0, decode_len - 1), (1, 0), (1, 1), (1, 2)]  # (request, position) of each new token
    slots = torch.tensor([PROBE_BLOCKS[r][p // block_size] * block_size + p % block_size for r, p in positions])
    num_tokens = len(positions)
    cache_shape = (len(PROBE_BLOCKS[0]) + len(PROBE_BLOCKS[1]) + 1, block_size, kv_heads, head_dim)
    return ProbeStep(query=randn(num_tokens, heads, head_dim), key=randn(num_tokens, kv_heads, head_dim),
                     value=randn(num_tokens, kv_heads, head_dim), key_cache=randn(*cache_shape),
                     value_cache=randn(*cache_shape),
                     metadata=step_metadata_for(requests, slots, 1, device),
                     spec=KVCacheSpec(1, block_size, kv_heads, head_dim, dtype))


def reference_output(step: ProbeStep, scale: float) -> torch.Tensor:
    """Causal attention of each query over its request's cache (after the write), in float32."""
    metadata, block_size = step.metadata, step.spec.block_size
    starts, lens = metadata.query_start_loc_cpu.tolist(), metadata.seq_lens_cpu.tolist()
    group = step.query.shape[1] // step.key_cache.shape[2]
    out = torch.empty(step.query.shape, dtype=torch.float32, device=step.query.device)
    for r, blocks in enumerate(PROBE_BLOCKS):
        seq_len, first, last = lens[r], starts[r], starts[r + 1]
        index = torch.tensor(blocks, device=step.key_cache.device)
        k = step.key_cache.index_select(0, index).flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        v = step.value_cache.index_select(0, index).flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        q = step.query[first:last].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        query_pos = torch.arange(seq_len - (last - first), seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[first:last] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def probe_backend(backend: Any, shape: AttentionShape, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> Optional[str]:
    """None when `backend` runs the probe step here and agrees with the reference; else why not."""
    step = probe_step(shape, block_size, dtype, device)
    scale = shape.head_dim ** -0.5
    try:
        metadata = backend.build_metadata(step.metadata, step.spec)
        backend.write_kv(step.key, step.value, step.key_cache, step.value_cache, metadata)
        out = backend.attend(step.query, step.key, step.value, step.key_cache, step.value_cache, metadata, scale)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)  # a launch failure surfaces here, not at the first step
    except Exception as exc:  # noqa: BLE001 - any failure means the kernel cannot serve this configuration
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"its probe call failed ({type(exc).__name__}: {message})"
    if tuple(out.shape) != tuple(step.query.shape):
        return f"its probe call returned shape {tuple(out.shape)}, not {tuple(step.query.shape)}"
    error = (out.float() - reference_output(step, scale)).abs().max().item()
    if not error <= PROBE_MAX_ABS_ERROR:  # NaN included
        return f"its probe call gave wrong results (max abs error {error:.3g} against a float32 reference)"
    return None
