"""The decode forward for small batches on the cpu backend: one native call for every layer of the step
(csrc/decode_layer.cpp) instead of ~11 operator calls per layer.

    per layer   decode_qkv      [residual += h;] norm; qkv product; RoPE; K/V into the cache; -> queries
                paged_decode    attention of each query over its sequence's cache
                decode_o_mlp    o product; residual += ; norm; gate|up product; SiLU * up; down product
    then        residual + h (before the final norm), as `LlamaForCausalLM.forward` returns

The two fused kernels are one OpenMP team each, running the products through the small-batch kernel of
csrc/gemv.cpp, with every intermediate rounded where the unfused ops round it: the result is the unfused
path's, bit for bit. It applies to steps whose every token is a decode (one new token per sequence) of at
most `max_rows` sequences, on plain (not quantized) weights in the model's dtype, a KV cache of that dtype,
and models without q/k norms; anything else takes the general path.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kernels.cpu import CpuKernels


WEIGHT_COLUMNS = ("input_norm", "qkv", "qkv_bias", "o_proj", "o_bias", "post_norm", "gate_up", "gate_up_bias",
                  "down", "down_bias")
"""A layer's row of the weight table, in csrc/decode_layer.cpp's WeightColumn order."""


class FusedDecode:
    def __init__(self, kernels: CpuKernels, max_rows: int):
        self.kernels = kernels
        self.max_rows = max_rows
        self._model_ok: Optional[bool] = None  # decided once, on the first step (the weights are loaded)
        self._weights: Optional[torch.Tensor] = None  # [num_layers, len(WEIGHT_COLUMNS)] int64 addresses
        self._caches: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None
        self._caches_of: Optional[Sequence] = None  # the kv_caches sequence they were split from

    def takes(self, model, num_tokens: int, metadata: AttentionMetadata,
              kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend) -> bool:
        """Whether this step can run fused (cheap after the first call)."""
        if num_tokens == 0 or num_tokens > self.max_rows or backend.name != "cpu":
            return False
        if metadata.num_decodes != num_tokens:
            return False
        if self._model_ok is None:
            self._model_ok = _model_fits(model, kv_caches)
        return self._model_ok

    def forward(self, model, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                metadata: AttentionMetadata) -> torch.Tensor:  # [num_tokens, hidden], before the final norm
        arch, rotary = model.arch, model.rotary
        if self._weights is None:
            self._weights = _weight_table(model)
        if self._caches_of is not kv_caches:
            self._caches = [k for k, _ in kv_caches], [v for _, v in kv_caches]
            self._caches_of = kv_caches
        residual = F.embedding(input_ids, model.embed)  # [T, hidden], updated in place layer by layer
        h = self.kernels.decode_layers(
            residual, self._weights, *self._caches, positions, rotary.cos, rotary.sin_signed, metadata.slot_mapping,
            metadata.decode_block_tables, metadata.decode_context_lens, arch.num_heads, arch.intermediate_size,
            arch.rms_norm_eps, model.scale)
        return residual + h


def _weight_table(model) -> torch.Tensor:
    """[num_layers, len(WEIGHT_COLUMNS)] int64: the address of each layer's tensors (0: no bias); the model
    keeps them alive and never moves them."""
    rows = [[0 if getattr(layer, name) is None else getattr(layer, name).data_ptr() for name in WEIGHT_COLUMNS]
            for layer in model.layers]
    return torch.tensor(rows, dtype=torch.int64)


def _model_fits(model, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Plain contiguous weights and caches in the model's dtype, no q/k norm, RoPE tables in that dtype."""
    dtype = model.dtype
    tensors = [model.embed, model.rotary.cos, model.rotary.sin_signed]
    for layer in model.layers:
        if layer.q_norm is not None:
            return False
        tensors += [layer.input_norm, layer.qkv, layer.o_proj, layer.post_norm, layer.gate_up, layer.down]
        tensors += [b for b in (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias) if b is not None]
    for key_cache, value_cache in kv_caches:
        tensors += [key_cache, value_cache]
    return all(type(t) is torch.Tensor and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
               and t.layout == torch.strided for t in tensors)
