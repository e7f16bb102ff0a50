"""The CPU backend: decodes through the native paged kernel; prompt chunks through the native prefill kernels
(bf16: csrc/prefill_attention.cpp, AVX512-BF16 builds on CPUs without AMX; float32 over float32, bf16 or fp8
caches: prefill_attention_f32.cpp, AVX-512 or AVX2 builds); other chunks that continue a cached prefix as two
mask-free flash calls (prefix_attention.py), the rest as the torch backend does. A chunk with bidirectional
ranges (an image of Gemma 3) takes the torch backend's masked path: the native kernels and the flash merge are
causal by construction, and such a chunk is one per image, beside decodes that keep the native kernel."""

from __future__ import annotations

import torch

from engine.attention.layer_attention import FEATURES, SINKS, LayerAttention
from engine.attention.metadata import AttentionMetadata, PrefillChunk, decode_and_chunks
from engine.attention.prefix_attention import prefix_and_chunk_attention
from engine.attention.step_metadata import BIDIRECTIONAL_SPANS, StepMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.amx import torch_bf16_products_use_amx
from engine.kernels.cpu import PREFILL_HEAD_DIMS, CpuKernels
from engine.attention.kv_cache import KVCacheSpec, from_cache, kv_scale, select_blocks, to_cache


class CpuAttentionBackend(TorchAttentionBackend):
    """Decode queries read K/V in place from the paged cache (csrc/paged_decode.cpp): no gather into a
    padded copy, no mask, no wasted (head, kv head) pairs: a fraction of the torch backend's gather +
    products per layer (measured in docs/performance.md)."""

    name = "cpu"
    cuda_graphs = False  # CPU only
    split_sequences = True  # the kernel may split a long sequence across threads when the batch is small
    # the decode kernel starts each sequence at its window, caps its scores, adds the sinks to its denominators
    attention_features: tuple[str, ...] = (*FEATURES, SINKS, BIDIRECTIONAL_SPANS)  # (the spans: the torch path)

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels
        # prompt chunks on the native kernel where torch's flash attention runs its products in float32; on AMX
        # CPUs oneDNN takes them to the tiles, measured there at 200-260 GFLOP/s per thread (docs/performance.md)
        self.torch_uses_amx = torch_bf16_products_use_amx()

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        # the paged decode kernel is built for these (KERNEL_DTYPES), and for fp8 caches under either
        return (torch.float32, torch.bfloat16, torch.float8_e4m3fn)

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
        # a cache in another dtype than the model's (--kv-cache-dtype): float32 or bf16, the kernel runs in the
        # cache's dtype, so the query is rounded to it (the kernel accumulates in float32 either way); fp8, the
        # kernel widens K/V as it reads them and keeps the query's dtype
        fp8 = key_cache.dtype == torch.float8_e4m3fn
        tables, lens = metadata.decodes()
        stored = kv_scale(key_cache.dtype)  # K and V = stored x this: one factor on the scores, one on the output
        out = self.kernels.paged_decode(
            (query if fp8 else query.to(key_cache.dtype)).contiguous(),
            key_cache,
            value_cache,
            tables,
            lens,
            layer.scale * stored,
            self.split_sequences,
            window=layer.sliding_window,
            softcap=layer.softcap,
            sinks=layer.sinks,
        )
        return (out if stored == 1.0 else out * stored).to(query.dtype)

    def _prefill(  # type: ignore[override]
        self,
        query: torch.Tensor,  # [query_len, num_heads, head_dim]
        key: torch.Tensor,  # [query_len, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        chunk: PrefillChunk,
        layer: LayerAttention,
    ) -> torch.Tensor:
        prefix = chunk.context_len - chunk.query_len
        plain = layer.sliding_window is None and layer.softcap is None and layer.sinks is None
        if chunk.bidirectional:
            return super()._prefill(query, key, value, key_cache, value_cache, chunk, layer)
        if plain and layer.latent_rank is None and self._native_prefill(query, key_cache, value_cache):
            # the chunk's own K/V are in the cache already (written before attention), in the step's dtype
            return self.kernels.prefill_attention(
                query.contiguous(), key_cache, value_cache, chunk.block_table, chunk.context_len, layer.scale
            )
        if prefix == 0 or not plain or layer.latent_rank is not None:  # K/V rounded as cached there too
            return super()._prefill(query, key, value, key_cache, value_cache, chunk, layer)
        # only the prefix comes from the cache: the chunk's own K/V are the step's
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        table = chunk.block_table[: -(-prefix // block_size)]
        prefix_k = from_cache(select_blocks(key_cache, table).view(-1, num_kv_heads, head_dim)[:prefix], query.dtype)
        prefix_v = select_blocks(value_cache, table).view(-1, num_kv_heads, value_cache.shape[-1])[:prefix]
        prefix_v = from_cache(prefix_v, query.dtype)

        def heads_first(t: torch.Tensor) -> torch.Tensor:  # [len, heads, dim] -> [1, heads, len, dim]
            return t.transpose(0, 1).unsqueeze(0)

        out = prefix_and_chunk_attention(
            heads_first(query),
            heads_first(from_cache(to_cache(key, key_cache.dtype), query.dtype)),  # rounded as the cache holds them
            heads_first(from_cache(to_cache(value, value_cache.dtype), query.dtype)),
            heads_first(prefix_k),
            heads_first(prefix_v),
            layer.scale,
        )
        return out[0].transpose(0, 1)  # [query_len, num_heads, head_dim]

    def _native_prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
        """Whether a native prefill kernel serves this chunk: bf16 queries over bf16 or fp8 caches on an
        AVX512-BF16 build of a CPU without AMX (the kernel widens fp8 as it reads it; an fp32 cache under a bf16
        model keeps the torch path, which rounds the chunk's keys as its own), float32 queries over a float32,
        bf16 or fp8 cache on an AVX-512 or AVX2 build (torch's flash kernel runs float32 on FMAs on AMX CPUs
        too); a head size they are built for, and a cache read as stored (fp8's scale 1)."""
        return (
            not (query.dtype == torch.bfloat16 and self.torch_uses_amx)
            and key_cache.dtype == value_cache.dtype
            and self.kernels.prefill_attention_serves(query.dtype, key_cache.dtype)
            and kv_scale(key_cache.dtype) == 1.0
            and query.shape[-1] in PREFILL_HEAD_DIMS
            and key_cache.shape[-1] == query.shape[-1]
            and value_cache.shape == key_cache.shape
        )
