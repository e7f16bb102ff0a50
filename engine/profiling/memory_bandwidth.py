"""The physical floor of a decode step: the bytes it must read from memory over the memory's measured
streaming-read bandwidth.

    read bandwidth  a sum over a buffer many times larger than the last-level cache (every byte comes
                    from DRAM, or HBM on a GPU), the best of several runs: what this process can stream
    bytes per step  every weight matrix of the forward pass (the projections, the LM head) plus the
                    K/V the step's attention reads; embeddings and norms are negligible

A library's kernel speed is never the floor (torch's batch-1 product on CPU runs several times below
it); this is.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from engine.quantization.quantized_weight import QuantizedWeight

DEFAULT_BUFFER_BYTES = 1 << 30
"""Large against any CPU's last-level cache (tens to hundreds of MiB) and quick to sum."""


def read_bandwidth(
    device: torch.device,
    nbytes: int = DEFAULT_BUFFER_BYTES,
    repeats: int = 5,
    buffer: Optional[torch.Tensor] = None,
) -> float:
    """Bytes per second a reduction streams from memory on `device` (the best of `repeats` runs). `buffer`: a
    float32 tensor to read instead of a new one of `nbytes` (a caller measuring again and again allocates it
    once: `read_buffer`)."""
    if buffer is None:
        buffer = read_buffer(device, nbytes)
    best = float("inf")
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        buffer.sum()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def read_buffer(device: torch.device, nbytes: int = DEFAULT_BUFFER_BYTES) -> torch.Tensor:
    """A buffer for `read_bandwidth`, touched once (its pages mapped, the thread pool awake)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    buffer.sum()
    return buffer


def tensor_bytes(weights: Sequence) -> int:
    """Bytes of distinct weights as stored (a tied matrix once; None skipped): tensors by their elements
    (opaque packed layouts by their logical element count), quantized weights by the bytes their product
    reads, other packed forms (a batch-invariant PackedWeight) by their `data` tensor."""
    seen: set[int] = set()
    total = 0
    for weight in weights:
        if weight is None or id(weight) in seen:
            continue
        seen.add(id(weight))
        if isinstance(weight, QuantizedWeight):
            total += weight.nbytes
        else:
            tensor = weight if isinstance(weight, torch.Tensor) else weight.data
            total += tensor.numel() * tensor.element_size()
    return total


def kv_read_bytes(num_layers: int, context_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of `context_tokens` tokens in every layer: what one decode's attention reads."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * context_tokens * num_kv_heads * head_dim * element


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
