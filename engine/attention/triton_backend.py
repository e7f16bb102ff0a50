"""The `triton` backend: the Triton paged-attention kernels of engine/kernels/triton over the step's metadata.

The kernels read the step's StepMetadata as it is (cu_seqlens_q, int32 seq lens, one int32
block table), so the backend builds nothing of its own. It is meant for CUDA; on a machine
without a GPU it runs only under Triton's interpreter (`TRITON_INTERPRET=1` before the
kernels are imported), which is for testing: orders of magnitude slower than `cpu`.
"""

from __future__ import annotations

import os

import torch

from engine.attention.layer_attention import FEATURES, SINKS, LayerAttention
from engine.attention.step_metadata import StepMetadata, check_causal
from engine.attention.kv_cache import FP8_DTYPES, KVCacheSpec, is_fp8, kv_scale, to_cache


class TritonAttentionBackend:
    """write_kv through slot_mapping, then one varlen paged-attention call for the whole batch."""

    name = "triton"
    cuda_graphs = True  # the metadata is the step's device views; the decode grid comes from their shapes
    attention_features = (*FEATURES, SINKS)  # windows, soft-caps and sinks are constexpr variants of the kernels

    def __init__(self):
        from engine.kernels import triton as kernels  # imported (and decorated) only when chosen

        self._kernels = kernels
        self._widening: int | None = None  # how the kernels widen an fp8 cache here: found at the first call

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        # the query is converted to the cache's dtype; over fp8 the kernels widen K/V to the query's instead
        return (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)

    def build_metadata(self, step: StepMetadata, spec: KVCacheSpec) -> StepMetadata:
        check_causal(step, self.name)
        return step

    def write_kv(self, key, value, key_cache, value_cache, metadata: StepMetadata) -> None:
        if is_fp8(key_cache.dtype):  # rounded as the other backends round (to_cache: torch's)
            key, value = to_cache(key, key_cache.dtype), to_cache(value, value_cache.dtype)
        self._kernels.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)

    def attend(self, query, key, value, key_cache, value_cache, metadata: StepMetadata, layer: LayerAttention):
        fp8 = is_fp8(key_cache.dtype)
        # the kernels take one dtype: a query in another than the cache's (--kv-cache-dtype) is converted,
        # except over fp8, whose K/V the kernels widen to the query's dtype as they read them
        stored = kv_scale(key_cache.dtype)  # K and V = stored x this: one factor on the scores, one on the output
        out = self._kernels.paged_attention(
            query if fp8 else query.to(key_cache.dtype),
            key_cache,
            value_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            layer.scale * stored,
            metadata.max_query_len,
            window=layer.sliding_window,
            softcap=layer.softcap,
            sinks=layer.sinks,
            widening=self._widening_for(key_cache) if fp8 else None,
        )
        if stored != 1.0:
            out = out * stored
        return out.to(query.dtype)

    def _widening_for(self, cache: torch.Tensor) -> int:
        """The kernels' KV_FP8 for this backend's fp8 cache, asked of the device once (not per layer and step)."""
        if self._widening is None:
            self._widening = self._kernels.kv_widening(cache)
        return self._widening


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the triton backend cannot run here (None when it can)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None  # the interpreter: tests only
    return (
        f"Triton kernels run on CUDA (on {device.type} only under TRITON_INTERPRET=1, for testing); "
        "use 'cpu' or 'torch'"
    )
