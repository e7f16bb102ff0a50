"""The physical paged KV cache: one K and one V tensor per layer, in the KV cache dtype.

The cache may store a narrower dtype than the model computes in (`--kv-cache-dtype`): bfloat16 for
an fp32 model halves the cache's bytes (twice the tokens in the same budget) and what decode
attention reads; fp8 (e4m3, CUDA) quarters them. The attention backends convert on write (the new
K/V to the cache's dtype, divided by `kv_scale` for fp8) and on read (back to the query's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "fp8": torch.float8_e4m3fn}
FP8_KV_SCALE = 1.0
"""K/V = stored value x scale. Without scales calibrated for the checkpoint every layer uses 1.0 (vLLM's
default too): e4m3 spans +-448, well beyond the K/V activations of Llama-family models."""


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device,
                           attention_backend: str) -> torch.dtype:
    """The cache's torch dtype for `--kv-cache-dtype` (auto: the model's); ValueError naming the flag."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r}: choose auto, {', '.join(KV_CACHE_DTYPES)}")
    dtype = KV_CACHE_DTYPES[name]
    if name == "fp8":
        if device.type != "cuda":
            raise ValueError("--kv-cache-dtype fp8 runs on CUDA only; on CPU use bfloat16 (or auto)")
        if attention_backend != "torch":
            raise ValueError(f"--kv-cache-dtype fp8 is read by the torch attention backend only (this engine "
                             f"runs {attention_backend!r}): add --attention-backend torch, or use bfloat16")
    if attention_backend == "flash" and dtype != model_dtype:
        raise ValueError(f"--kv-cache-dtype {name}: flash-attn reads a cache in the model's dtype "
                         f"({str(model_dtype).removeprefix('torch.')}); use auto or another attention backend")
    if attention_backend.startswith("cpu") and name not in ("float32", "bfloat16"):  # cpu, cpu-batch-invariant
        raise ValueError(f"--kv-cache-dtype {name}: the {attention_backend} attention backend's kernels read float32 "
                         "or bfloat16 caches; use one of those or --attention-backend torch")
    return dtype


def kv_scale(dtype: torch.dtype) -> float:
    """What a stored K/V element is multiplied by when read (1 unless the cache is fp8)."""
    return FP8_KV_SCALE if dtype == torch.float8_e4m3fn else 1.0


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New K or V in the cache's dtype (scaled into fp8's range when the cache is fp8)."""
    if x.dtype == cache_dtype:
        return x
    if cache_dtype == torch.float8_e4m3fn:
        return (x.float() / kv_scale(cache_dtype)).to(cache_dtype)
    return x.to(cache_dtype)


def as_stored(x: torch.Tensor) -> torch.Tensor:
    """`x` viewed as its bytes when it is fp8 (index_copy_ / index_select have no float8 kernels), else `x`."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def select_blocks(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`cache.index_select(0, index)`, fp8 caches included."""
    return as_stored(cache).index_select(0, index).view(cache.dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V (any shape) in the compute dtype `dtype`."""
    if x.dtype == dtype:
        return x
    if x.dtype == torch.float8_e4m3fn:
        return (x.to(torch.float32) * kv_scale(x.dtype)).to(dtype)
    return x.to(dtype)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of one layer's cache block."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


class KVCache:
    """Per layer, K and V of shape `[num_blocks + 1, block_size, num_kv_heads, head_dim]`
    (the layout flash-attn's paged kernels read). The scheduler's KVCacheManager
    decides which of blocks 0 .. num_blocks - 1 belong to whom; this class only holds
    the memory. The last block, `pad_block`, is never handed out: the padding rows of a
    CUDA-graph step write and read it (engine/runner/cuda_graphs.py)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        shape = (num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.spec = spec
        self.num_blocks = num_blocks
        self.pad_block = num_blocks
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
            for _ in range(spec.num_layers)
        ]

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block
