"""The CPU backend: decodes through the native paged kernel, prefill chunks as the torch backend does."""

from __future__ import annotations

from typing import Optional

import torch

from engine.attention.metadata import AttentionMetadata, decode_and_chunks
from engine.attention.step_metadata import StepMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu import CpuKernels
from engine.models.layer_ops import NativeLayerOps
from engine.models.invariant_linear import ColumnBlockLinear
from engine.models.linear import GemvLinear, Linear
from engine.runner.kv_cache import KVCacheSpec

AMX_GEMV_MAX_ROWS = 4
"""On AMX CPUs whose kernels lack the tile path, bf16 products beyond this many rows go to `F.linear` (oneDNN
on the tiles). 2-core Xeon, 2 threads, 3072 x 576: native 63 / 106 / 188 us at 1 / 4 / 8 rows, `F.linear`
115 / 124 / 125; bench offline --num-prompts 16: 393-397 tok/s, against 277-285 on vdpbf16ps column blocks."""


def torch_bf16_products_use_amx() -> bool:
    """Whether this CPU has AMX tiles, which oneDNN's bf16 products run on (Sapphire Rapids and newer)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private in torch 2.x
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


class CpuAttentionBackend(TorchAttentionBackend):
    """Decode queries read K/V in place from the paged cache (csrc/paged_decode.cpp): no gather into a
    padded copy, no mask, no wasted (head, kv head) pairs. Measured on a 2-core AVX2 machine, batch 64 at
    ~190 cached tokens: 1.9 ms per layer against ~4.8 ms for the torch backend's gather + products."""

    name = "cpu"
    cuda_graphs = False  # CPU only
    split_sequences = True  # the kernel may split a long sequence across threads when the batch is small

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)  # the paged decode kernel is built for these (KERNEL_DTYPES)

    def layer_ops(self) -> NativeLayerOps:
        """The same native library also fuses the per-token ops between the products."""
        return NativeLayerOps(self.kernels)

    def linear(self, dtype: torch.dtype) -> Optional[Linear]:
        """bfloat16: the native column-block product at every row count where it runs on AVX512-BF16 and
        passed its load-time self-check; on AMX CPUs only with its tile path built in and granted (on
        vdpbf16ps alone it takes 281-287 us for 16 rows of 3072 x 576 there, on the tiles 73). Else the native
        small-batch product up to 8 rows (AMX: 4) and torch's beyond. float32 keeps oneDNN's packed weights."""
        if dtype != torch.bfloat16:
            return None
        kernels = self.kernels
        amx_cpu = torch_bf16_products_use_amx()
        if kernels.bf16_column_blocks and kernels.invariant_product_ok and (kernels.amx_tiles or not amx_cpu):
            return ColumnBlockLinear(kernels)
        return GemvLinear(kernels, AMX_GEMV_MAX_ROWS) if amx_cpu else GemvLinear(kernels)

    def build_metadata(self, step: StepMetadata, spec: KVCacheSpec) -> AttentionMetadata:
        return decode_and_chunks(step, spec.block_size)  # the kernel stops at each context length: no mask

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        # a cache in another dtype than the model's (--kv-cache-dtype): the kernel runs in the cache's dtype,
        # so the query is rounded to it (the kernel accumulates in float32 either way)
        out = self.kernels.paged_decode(query.to(key_cache.dtype).contiguous(), key_cache, value_cache,
                                        metadata.decode_block_tables, metadata.decode_context_lens, scale,
                                        self.split_sequences)
        return out.to(query.dtype)
