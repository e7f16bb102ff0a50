"""The native CPU kernels as torch operators, `torch.ops.pagedserve.cpu_*`, so torch.compile can trace
through them (each has a fake implementation giving its output's shape) and the dispatcher knows which
arguments each one writes.

    cpu_paged_decode(query, key_cache, value_cache, block_tables, context_lens, scale, split, window, softcap,
                     sinks?, fn) -> out                             window 0 / softcap 0.0 / sinks None: none
    cpu_rms_norm(x, weight, eps, fn) -> out
    cpu_add_rms_norm(x, residual!, weight, eps, fn) -> out         residual += x, in place
    cpu_silu_and_mul(gate_up, fn) -> out
    cpu_gelu_tanh_and_mul(gate_up, fn) -> out                        GeGLU: gelu(gate, tanh) * up
    cpu_rotary_(x!, positions, cos, sin_signed, fn) -> ()           x rotated in place
    cpu_invariant_linear(x, packed, bias?, out_features, amx, fn) -> out
    cpu_gemv(x, weight, bias?, fn) -> out                           x [rows, in] @ weight [out, in]^T + bias
    cpu_decode_layers(residual!, weights, key_caches!, value_caches!, positions, cos, sin_signed, slots,
                      block_tables, context_lens, lora_table?, lora_slots?, lora_scales?, lora_ranks?,
                      layer_table?, lora_max_rank, heads, inter, qk_norm_projection, gelu, eps, scale,
                      residual_scale, softcap, fn) -> out
                                                                    every layer of a small decode step
    cpu_lora_add_(x, out!, a, b, slots, scales, ranks, widths, max_rank, grouped, fn) -> ()
                                                                    out += a projection's LoRA deltas
    cpu_prefill_attention(query, key_cache, value_cache, block_table, context_len, scale, fn) -> out
                                                                    a bf16 or float32 prompt chunk over its cache

`fn` is the address of the compiled function for the arguments' dtype (CpuKernels resolves it): the
operators hold no reference to a loaded library, so they are defined once, here, whatever loads it.
The shape and dtype checks stay in CpuKernels, in front of the operators.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Optional

import torch

SIGNATURES: dict[str, list[type[ctypes._SimpleCData[Any]]]] = {
    "paged_decode": [ctypes.c_void_p] * 6
    + [ctypes.c_int64] * 6
    + [ctypes.c_float, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p],
    "rms_norm": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float],
    "add_rms_norm": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float],
    "silu_and_mul": [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2,
    "gelu_tanh_and_mul": [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2,
    "rotary": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5,
    "invariant_linear": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4,
    "gemv": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3,
    "decode_layers": [ctypes.c_void_p] * 16 + [ctypes.c_int64] * 15 + [ctypes.c_float] * 4,
    "lora_add": [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 8,
}
"""Argument types of each C entry point (`pagedserve_<name>_<f32|bf16>`)."""

PROTOTYPES = {name: ctypes.CFUNCTYPE(None, *argtypes) for name, argtypes in SIGNATURES.items()}

PREFILL_ATTENTION = ctypes.CFUNCTYPE(ctypes.c_int64, *([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_float]))
"""`pagedserve_prefill_attention_<bf16|bf16_fp8|f32>` (outside SIGNATURES' per-dtype pairs: which of them a build
serves depends on its instruction set): 1 when it ran."""


class Overloads:
    """The operators' default overloads, looked up once (a call through `torch.ops.pagedserve.x` resolves
    the overload every time)."""

    def __init__(self):
        ops = torch.ops.pagedserve
        self.cpu_paged_decode = ops.cpu_paged_decode.default
        self.cpu_rms_norm = ops.cpu_rms_norm.default
        self.cpu_add_rms_norm = ops.cpu_add_rms_norm.default
        self.cpu_silu_and_mul = ops.cpu_silu_and_mul.default
        self.cpu_gelu_tanh_and_mul = ops.cpu_gelu_tanh_and_mul.default
        self.cpu_rotary_ = ops.cpu_rotary_.default
        self.cpu_invariant_linear = ops.cpu_invariant_linear.default
        self.cpu_gemv = ops.cpu_gemv.default
        self.cpu_decode_layers = ops.cpu_decode_layers.default
        self.cpu_lora_add_ = ops.cpu_lora_add_.default
        self.cpu_prefill_attention = ops.cpu_prefill_attention.default


def _call(name: str, fn: int, *args) -> None:
    _callable(name, fn)(*args)


@functools.lru_cache(maxsize=64)
def _callable(name: str, fn: int):
    """The callable for the entry point at address `fn`, made once (building one costs more than the call it
    makes: docs/performance.md)."""
    return PROTOTYPES[name](fn)


def _define(name: str, schema: str, kernel, fake) -> None:
    """`pagedserve::name` with its CPU kernel and its fake (shape-only) implementation. The schema
    marks what an operator writes in place (`Tensor(a!)`). torch.library.define/impl, not the custom_op
    decorator, whose wrapper costs about twice the dispatch per call, per layer (docs/performance.md)."""
    qualname = f"pagedserve::{name}"
    torch.library.define(qualname, schema)
    torch.library.impl(qualname, "cpu", kernel)
    torch.library.register_fake(qualname, fake)


def paged_decode(
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale,
    split,
    window,
    softcap,
    sinks: Optional[torch.Tensor],
    fn,
):
    """cpu_paged_decode's kernel."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    _call(
        "paged_decode",
        fn,
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        scale,
        split,
        window,
        softcap,
        None if sinks is None else sinks.data_ptr(),
    )
    return out


def rms_norm(x, weight, eps, fn):
    """cpu_rms_norm's kernel."""
    out = torch.empty_like(x)
    _call("rms_norm", fn, x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def add_rms_norm(x, residual, weight, eps, fn):
    """cpu_add_rms_norm's kernel."""
    out = torch.empty_like(x)
    _call(
        "add_rms_norm",
        fn,
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
    )
    return out


def silu_and_mul(gate_up, fn):
    """cpu_silu_and_mul's kernel."""
    return _gated("silu_and_mul", gate_up, fn)


def gelu_tanh_and_mul(gate_up, fn):
    """cpu_gelu_tanh_and_mul's kernel."""
    return _gated("gelu_tanh_and_mul", gate_up, fn)


def _gated(name: str, gate_up, fn):
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, width))
    _call(name, fn, gate_up.data_ptr(), out.data_ptr(), rows, width)
    return out


def rotary_(x, positions, cos, sin_signed, fn):
    """cpu_rotary_'s kernel."""
    rows, heads, head_dim = x.shape
    _call(
        "rotary",
        fn,
        x.data_ptr(),
        positions.data_ptr(),
        cos.data_ptr(),
        sin_signed.data_ptr(),
        rows,
        x.stride(0),
        heads,
        head_dim,
        cos.shape[-1],  # rotary_dim: the tables' width
    )


def invariant_linear(x, packed, bias: Optional[torch.Tensor], out_features, amx, fn):
    """cpu_invariant_linear's kernel."""
    rows, in_features = x.shape
    out = x.new_empty((rows, out_features))
    _call(
        "invariant_linear",
        fn,
        x.data_ptr(),
        packed.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows,
        out_features,
        in_features,
        amx,
    )
    return out


def gemv(x, weight, bias: Optional[torch.Tensor], fn):
    """cpu_gemv's kernel."""
    rows, in_features = x.shape
    out = x.new_empty((rows, weight.shape[0]))
    _call(
        "gemv",
        fn,
        x.data_ptr(),
        weight.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows,
        weight.shape[0],
        in_features,
    )
    return out


def _prefill_attention(query, key_cache, value_cache, block_table, context_len, scale, fn):
    query_len, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    served = PREFILL_ATTENTION(fn)(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_table.data_ptr(),
        out.data_ptr(),
        query_len,
        context_len,
        heads,
        kv_heads,
        head_dim,
        block_size,
        scale,
    )
    if not served:
        raise ValueError(f"the prefill attention kernel is not built for head_dim {head_dim}")
    return out


def _addresses(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def _address(tensor: Optional[torch.Tensor]) -> Optional[int]:
    return None if tensor is None else tensor.data_ptr()


def _decode_layers(residual, weights, key_caches, value_caches, *arguments):
    """cpu_decode_layers' kernel (its schema names the arguments): `decode_layers_at` on these caches."""
    addresses = cache_addresses(key_caches, value_caches)
    return decode_layers_at(residual, weights, addresses, tuple(key_caches[0].shape), *arguments)


def cache_addresses(key_caches, value_caches) -> tuple[torch.Tensor, torch.Tensor]:
    """Each layer's key and value cache address, [num_layers] int64 each (what decode_layers reads)."""
    return _addresses(key_caches), _addresses(value_caches)


def decode_layers_at(
    residual,
    weights,
    addresses: tuple[torch.Tensor, torch.Tensor],  # cache_addresses(key_caches, value_caches)
    cache_shape: tuple[int, ...],  # [num_blocks, block_size, kv_heads, head_dim], every layer's
    positions,
    cos,
    sin_signed,
    slots,
    block_tables,
    context_lens,
    lora_table: Optional[torch.Tensor],
    lora_slots: Optional[torch.Tensor],
    lora_scales: Optional[torch.Tensor],
    lora_ranks: Optional[torch.Tensor],
    layer_table: Optional[torch.Tensor],
    lora_max_rank,
    heads,
    inter,
    qk_norm_projection,
    gelu,
    eps,
    scale,
    residual_scale,
    softcap,
    fn,
):
    """cpu_decode_layers' kernel over caches given by their addresses: eagerly, a caller whose caches stay
    reads them once (a step's share worth saving: docs/performance.md)."""
    rows, hidden = residual.shape
    _, block_size, kv_heads, head_dim = cache_shape
    out = torch.empty_like(residual)
    keys, values = addresses
    _call(
        "decode_layers",
        fn,
        residual.data_ptr(),
        weights.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        positions.data_ptr(),
        cos.data_ptr(),
        sin_signed.data_ptr(),
        slots.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        _address(lora_table),
        _address(lora_slots),
        _address(lora_scales),
        _address(lora_ranks),
        _address(layer_table),
        weights.shape[0],
        rows,
        hidden,
        heads,
        kv_heads,
        head_dim,
        cos.shape[1],  # the rotated dimensions of each head (all of it but with partial rotary)
        inter,
        block_size,
        block_tables.shape[1],
        0 if lora_slots is None else lora_slots.shape[1],
        lora_max_rank,
        0 if lora_ranks is None else lora_ranks.shape[0],
        int(qk_norm_projection),
        int(gelu),
        eps,
        scale,
        residual_scale,
        softcap,
    )
    return out


def lora_add_(x, out, a, b, slots, scales, ranks, widths, max_rank, grouped, fn):
    """cpu_lora_add_'s kernel."""
    rows, in_features = x.shape
    max_loras, rows_per_slot, _ = a.shape
    widths_table = torch.tensor(widths, dtype=torch.int64)
    _call(
        "lora_add",
        fn,
        x.data_ptr(),
        out.data_ptr(),
        a.data_ptr(),
        b.data_ptr(),
        slots.data_ptr(),
        scales.data_ptr(),
        ranks.data_ptr(),
        widths_table.data_ptr(),
        rows,
        in_features,
        out.shape[1],
        rows_per_slot // max_rank,
        max_rank,
        max_loras,
        slots.shape[1],
        grouped,
    )


def _like_first(x, *args):
    return torch.empty_like(x)


_define(
    "cpu_paged_decode",
    "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor context_lens, float scale, int split, int window, float softcap, Tensor? sinks, int fn) -> Tensor",
    paged_decode,
    _like_first,
)
_define("cpu_rms_norm", "(Tensor x, Tensor weight, float eps, int fn) -> Tensor", rms_norm, _like_first)
_define(
    "cpu_add_rms_norm",
    "(Tensor x, Tensor(a!) residual, Tensor weight, float eps, int fn) -> Tensor",
    add_rms_norm,
    _like_first,
)
_define(
    "cpu_silu_and_mul",
    "(Tensor gate_up, int fn) -> Tensor",
    silu_and_mul,
    lambda gate_up, fn: gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2)),
)
_define(
    "cpu_gelu_tanh_and_mul",
    "(Tensor gate_up, int fn) -> Tensor",
    gelu_tanh_and_mul,
    lambda gate_up, fn: gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2)),
)
_define(
    "cpu_rotary_",
    "(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin_signed, int fn) -> ()",
    rotary_,
    lambda x, positions, cos, sin_signed, fn: None,
)
_define(
    "cpu_invariant_linear",
    "(Tensor x, Tensor packed, Tensor? bias, int out_features, int amx, int fn) -> Tensor",
    invariant_linear,
    lambda x, packed, bias, out_features, amx, fn: x.new_empty((x.shape[0], out_features)),
)
_define(
    "cpu_gemv",
    "(Tensor x, Tensor weight, Tensor? bias, int fn) -> Tensor",
    gemv,
    lambda x, weight, bias, fn: x.new_empty((x.shape[0], weight.shape[0])),
)
_define(
    "cpu_decode_layers",
    "(Tensor(a!) residual, Tensor weights, Tensor(b!)[] key_caches, "
    "Tensor(c!)[] value_caches, "
    "Tensor positions, Tensor cos, Tensor sin_signed, Tensor slots, Tensor block_tables, Tensor context_lens, "
    "Tensor? lora_table, Tensor? lora_slots, Tensor? lora_scales, Tensor? lora_ranks, Tensor? layer_table, "
    "int lora_max_rank, int heads, int inter, bool qk_norm_projection, bool gelu, float eps, float scale, "
    "float residual_scale, float softcap, int fn) -> Tensor",
    _decode_layers,
    lambda residual, *rest: torch.empty_like(residual),
)
_define(
    "cpu_lora_add_",
    "(Tensor x, Tensor(a!) out, Tensor a, Tensor b, Tensor slots, Tensor scales, Tensor ranks, int[] widths, "
    "int max_rank, int grouped, int fn) -> ()",
    lora_add_,
    lambda *args: None,
)
_define(
    "cpu_prefill_attention",
    "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, int context_len, float scale, "
    "int fn) -> Tensor",
    _prefill_attention,
    lambda query, *rest: torch.empty_like(query),
)
