"""Paged steps through an attention backend, checked against a float32 reference: the start-up probe.

A library's signature says what it accepts, not what its kernels run: flash-attn 4 before
4.0.0b5 asserts "paged KV not supported on SM 9.0", SM 12.x still asserts, and SM 9.0 paging
refuses some head dims. So a backend is chosen only after it has run the exact configuration
the engine will give it (dtype, heads, head dim, block size) on the device, once, at start-up,
in the kernel variants serving reaches (each library picks its kernel by the step's shape):

    mixed step    a decode over a partial last block + a 200-token chunk over a 60-token cached
                  prefix + a 3-token prompt: causal prefill tiles, several query tiles per request
    decode step   three decodes of 300, 37 and 1 tokens: flash-attn 2's swapped-GQA split-KV
                  path (max_seqlen_q 1), key tiles walked across many pages

Blocks are handed out in a shuffled order. Values are random (standard deviation 0.5, so
outputs stay below 2 in magnitude and a half-precision step is at most 2**-7); a kernel that
runs but answers wrongly is refused too.
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple, Optional

import torch

from engine.attention.layer_attention import LayerAttention
from engine.attention.attention_shape import AttentionShape
from engine.attention.step_metadata import StepMetadata, step_metadata_for
from engine.attention.kv_cache import KVCacheSpec

PROBE_MAX_ABS_ERROR = 2e-2
PROBE_STEPS = {  # (seq_len, query_len) per request, decodes first; and the number of decodes
    "mixed step": ([(18, 1), (260, 200), (3, 3)], 1),
    "decode step": ([(300, 1), (37, 1), (1, 1)], 3),
}


class ProbeStep(NamedTuple):
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: this step's new K
    value: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], earlier tokens already there
    value_cache: torch.Tensor
    metadata: StepMetadata
    spec: KVCacheSpec
    blocks: list[list[int]]  # each request's block ids, in order


def probe_step(
    requests: list[tuple[int, int]],
    num_decodes: int,
    shape: AttentionShape,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> ProbeStep:
    """The inputs of one probe step on `device` (drawn on the CPU from a fixed seed)."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = shape

    def randn(*size: int) -> torch.Tensor:
        return (0.5 * torch.randn(*size, generator=generator)).to(dtype=dtype, device=device)

    counts = [-(-seq_len // block_size) for seq_len, _ in requests]
    ids = list(range(sum(counts) + 1))  # one block more than needed: a block nobody reads
    random.Random(0).shuffle(ids)
    blocks = [ids[sum(counts[:r]) : sum(counts[: r + 1])] for r in range(len(requests))]
    slots = [
        blocks[r][p // block_size] * block_size + p % block_size
        for r, (seq_len, query_len) in enumerate(requests)
        for p in range(seq_len - query_len, seq_len)
    ]
    num_tokens = len(slots)
    cache_shape = (len(ids), block_size, kv_heads, head_dim)
    metadata = step_metadata_for(
        [(s, q, b) for (s, q), b in zip(requests, blocks)], torch.tensor(slots), num_decodes, device
    )
    return ProbeStep(
        query=randn(num_tokens, heads, head_dim),
        key=randn(num_tokens, kv_heads, head_dim),
        value=randn(num_tokens, kv_heads, head_dim),
        key_cache=randn(*cache_shape),
        value_cache=randn(*cache_shape),
        metadata=metadata,
        spec=KVCacheSpec(1, block_size, kv_heads, head_dim, dtype),
        blocks=blocks,
    )


def reference_output(step: ProbeStep, scale: float) -> torch.Tensor:
    """Causal attention of each query over its request's cache (after the write), in float32."""
    starts, lens = step.metadata.query_start_loc_cpu.tolist(), step.metadata.seq_lens_cpu.tolist()
    group = step.query.shape[1] // step.key_cache.shape[2]
    out = torch.empty(step.query.shape, dtype=torch.float32, device=step.query.device)
    for r, blocks in enumerate(step.blocks):
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


def probe_backend(
    backend: Any, shape: AttentionShape, block_size: int, dtype: torch.dtype, device: torch.device
) -> Optional[str]:
    """None when `backend` runs every probe step here and agrees with the reference; else why not.

    RuntimeError when a step faulted the device: a CUDA context that took an illegal access stays
    broken, so no other backend could run in this process either."""
    for name, (requests, num_decodes) in PROBE_STEPS.items():
        failure = _probe_one(
            backend, probe_step(requests, num_decodes, shape, block_size, dtype, device), shape.head_dim**-0.5
        )
        if failure is not None:
            return f"its probe {name} {failure}"
    return None


def _probe_one(backend: Any, step: ProbeStep, scale: float) -> Optional[str]:
    try:
        metadata = backend.build_metadata(step.metadata, step.spec)
        backend.write_kv(step.key, step.value, step.key_cache, step.value_cache, metadata)
        out = backend.attend(
            step.query, step.key, step.value, step.key_cache, step.value_cache, metadata, LayerAttention(scale)
        )
        if out.is_cuda:
            torch.cuda.synchronize(out.device)  # a launch failure surfaces here, not at the first step
    except Exception as exc:  # noqa: BLE001 - any failure means the kernel cannot serve this configuration
        _check_device(step.query.device, exc)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"failed ({type(exc).__name__}: {message})"
    if tuple(out.shape) != tuple(step.query.shape):
        return f"returned shape {tuple(out.shape)}, not {tuple(step.query.shape)}"
    error = (out.float() - reference_output(step, scale)).abs().max().item()
    if not error <= PROBE_MAX_ABS_ERROR:  # NaN included
        return f"gave wrong results (max abs error {error:.3g} against a float32 reference)"
    return None


def _check_device(device: torch.device, failure: Exception) -> None:
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - the device itself is gone
        raise RuntimeError(
            f"the attention backend's start-up probe faulted the GPU ({type(failure).__name__}: "
            f"{failure}); the CUDA context cannot be used after that. Start again with "
            f"--attention-backend triton (or torch)"
        ) from exc
