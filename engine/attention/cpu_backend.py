"""The CPU backend: decodes through the native paged kernel, prefill chunks as the torch backend does."""

from __future__ import annotations

import torch

from engine.attention.layer_attention import FEATURES, SINKS, LayerAttention
from engine.attention.metadata import AttentionMetadata, decode_and_chunks
from engine.attention.step_metadata import StepMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu import CpuKernels
from engine.attention.kv_cache import KVCacheSpec


class CpuAttentionBackend(TorchAttentionBackend):
    """Decode queries read K/V in place from the paged cache (csrc/paged_decode.cpp): no gather into a
    padded copy, no mask, no wasted (head, kv head) pairs: a fraction of the torch backend's gather +
    products per layer (measured in docs/performance.md)."""

    name = "cpu"
    cuda_graphs = False  # CPU only
    split_sequences = True  # the kernel may split a long sequence across threads when the batch is small
    # the decode kernel starts each sequence at its window, caps its scores, adds the sinks to its denominators
    attention_features = (*FEATURES, SINKS)

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)  # the paged decode kernel is built for these (KERNEL_DTYPES)

    def build_metadata(self, step: StepMetadata, spec: KVCacheSpec) -> AttentionMetadata:
        return decode_and_chunks(step, spec.block_size)  # the kernel stops at each context length: no mask

    # An instance method where the torch backend's is a classmethod: the kernels are this instance's.
    def _decode(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        layer: LayerAttention,
    ) -> torch.Tensor:
        # a cache in another dtype than the model's (--kv-cache-dtype): the kernel runs in the cache's dtype,
        # so the query is rounded to it (the kernel accumulates in float32 either way)
        tables, lens = metadata.decodes()
        out = self.kernels.paged_decode(
            query.to(key_cache.dtype).contiguous(),
            key_cache,
            value_cache,
            tables,
            lens,
            layer.scale,
            self.split_sequences,
            window=layer.sliding_window,
            softcap=layer.softcap,
            sinks=layer.sinks,
        )
        return out.to(query.dtype)
