"""The block-quantized products of csrc/quant_gemm.cpp as torch operators, and the library that holds them.

    cpu_quant_linear(x, qs, d, m?, out_features, nbp, format, layout, tile_min_rows, fn) -> x @ W.T  [rows, out]
    cpu_quant_dequantize(qs, d, m?, out_features, in_features, nbp, format, layout, dtype, fn) -> W  [out, in]
    cpu_quant_dequantize_rows(qs, d, m?, index, out_features, in_features, nbp, format, layout, dtype, fn)
                                                                             -> W[index]  [n, in]

`qs`, `d`, `m` are a weight repacked by engine/quantization/gguf_formats.py (in its ROWS or X16 layout);
`fn` the address of the
compiled function for the float dtype. Each operator has a fake (shape-only) implementation so
torch.compile traces through it. `QuantKernels` resolves the addresses from a library built by
engine/kernels/cpu.py (the full build, or for tests a `-march=haswell` build of quant_gemm.cpp alone).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path
from typing import Any, Optional

import torch

from engine.kernels.amx import torch_bf16_products_use_amx

logger = logging.getLogger(__name__)

QUANT_SOURCES = ("quant_gemm.cpp", "quant_dense_bf16.cpp")
"""The sources of the quantized products alone (a build for another target, in tests)."""

SIGNATURES: dict[str, list[Any]] = {
    "quant_linear": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7,
    "quant_dequantize": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5,
    "quant_dequantize_rows": [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5,
}
"""Argument types of each C entry point (`pagedserve_<name>_<f32|bf16>`)."""

_RESULTS = {"quant_dequantize_rows": ctypes.c_int64}
"""Result types of the entry points that return one (the others return nothing)."""

_PROTOTYPES = {name: ctypes.CFUNCTYPE(_RESULTS.get(name), *argtypes) for name, argtypes in SIGNATURES.items()}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _address(tensor: Optional[torch.Tensor]) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def _quant_linear(
    x, qs, d, m: Optional[torch.Tensor], out_features, nbp, fmt, layout, tile_min_rows, fn, out_dtype=None
):
    rows, in_features = x.shape
    if layout and out_features % 16:
        raise ValueError(f"an X16 weight has a multiple of 16 rows, got {out_features}")
    out = x.new_empty((rows, out_features), dtype=out_dtype)  # [rows, out_features]
    _function("quant_linear", fn)(
        x.data_ptr(),
        qs.data_ptr(),
        d.data_ptr(),
        _address(m),
        out.data_ptr(),
        rows,
        in_features,
        out_features,
        nbp,
        fmt,
        layout,
        tile_min_rows,
    )
    return out


@functools.lru_cache(maxsize=64)
def _function(name: str, fn: int):
    """The callable for the entry point at address `fn`, made once (building one costs more than the call it
    makes: docs/performance.md)."""
    return _PROTOTYPES[name](fn)


def _quant_dequantize(qs, d, m: Optional[torch.Tensor], out_features, in_features, nbp, fmt, layout, dtype, fn):
    if layout and out_features % 16:
        raise ValueError(f"an X16 weight has a multiple of 16 rows, got {out_features}")
    out = torch.empty((out_features, in_features), dtype=dtype)  # [out_features, in_features]
    _function("quant_dequantize", fn)(
        qs.data_ptr(), d.data_ptr(), _address(m), out.data_ptr(), out_features, in_features, nbp, fmt, layout
    )
    return out


def _quant_dequantize_rows(
    qs, d, m: Optional[torch.Tensor], index, out_features, in_features, nbp, fmt, layout, dtype, fn
):
    if index.dtype != torch.int64 or index.dim() != 1 or not index.is_contiguous():
        raise ValueError(f"row indices are a contiguous 1-D int64 tensor, got {index.dtype} {tuple(index.shape)}")
    out = torch.empty((index.shape[0], in_features), dtype=dtype)  # [rows, in_features]
    bad = _function("quant_dequantize_rows", fn)(
        qs.data_ptr(),
        d.data_ptr(),
        _address(m),
        index.data_ptr(),
        index.shape[0],
        out.data_ptr(),
        out_features,
        in_features,
        nbp,
        fmt,
        layout,
    )
    if bad:
        raise IndexError(f"{bad} row indices outside [0, {out_features})")
    return out


def _define(name: str, schema: str, kernel, fake) -> None:
    qualname = f"pagedserve::{name}"
    torch.library.define(qualname, schema)
    torch.library.impl(qualname, "cpu", kernel)
    torch.library.register_fake(qualname, fake)


_define(
    "cpu_quant_linear",
    "(Tensor x, Tensor qs, Tensor d, Tensor? m, int out_features, int nbp, int fmt, "
    "int layout, int tile_min_rows, int fn) -> Tensor",
    _quant_linear,
    lambda x, qs, d, m, out_features, nbp, fmt, layout, tile_min_rows, fn: x.new_empty((x.shape[0], out_features)),
)
_define(
    "cpu_quant_dequantize",
    "(Tensor qs, Tensor d, Tensor? m, int out_features, int in_features, int nbp, "
    "int fmt, int layout, ScalarType dtype, int fn) -> Tensor",
    _quant_dequantize,
    lambda qs, d, m, out_features, in_features, nbp, fmt, layout, dtype, fn: qs.new_empty(
        (out_features, in_features), dtype=dtype
    ),
)


_define(
    "cpu_quant_dequantize_rows",
    "(Tensor qs, Tensor d, Tensor? m, Tensor index, int out_features, int in_features, int nbp, "
    "int fmt, int layout, ScalarType dtype, int fn) -> Tensor",
    _quant_dequantize_rows,
    lambda qs, d, m, index, out_features, in_features, nbp, fmt, layout, dtype, fn: qs.new_empty(
        (index.shape[0], in_features), dtype=dtype
    ),
)


class QuantKernels:
    """The quantized-product entry points of a built kernel library, called through the operators above."""

    def __init__(self, path: Path):
        self.path = path
        self._library = ctypes.CDLL(str(path))  # loaded while this object lives
        self._functions: dict[tuple[str, torch.dtype], int] = {}
        for name in SIGNATURES:
            for dtype, suffix in _SUFFIX.items():
                function = getattr(self._library, f"pagedserve_{name}_{suffix}")
                address = ctypes.cast(function, ctypes.c_void_p).value
                assert address is not None  # a symbol the library exports (getattr raised otherwise)
                self._functions[name, dtype] = address
        widening = ctypes.cast(self._library.pagedserve_quant_linear_bf16_f32, ctypes.c_void_p).value
        assert widening is not None  # as above
        self._widening_linear = widening
        tiles = ctypes.cast(self._library.pagedserve_quant_bf16_tiles, ctypes.c_void_p).value
        assert tiles is not None  # as above
        self.bf16_tiles = bool(ctypes.CFUNCTYPE(ctypes.c_int64)(tiles)())
        """Whether bf16 activations can take the bf16 tile product (an AVX512-BF16 build)."""
        self.amx_dense = torch_bf16_products_use_amx()
        """Whether torch's bf16 product runs on AMX tiles here: prefill-sized bf16 products then take the weight
        dequantized to bf16 and oneDNN (engine/quantization/gguf_weight.py, AMX_DENSE_MIN_ROWS)."""
        self._linear = torch.ops.pagedserve.cpu_quant_linear.default
        self._dequantize = torch.ops.pagedserve.cpu_quant_dequantize.default
        self._dequantize_rows = torch.ops.pagedserve.cpu_quant_dequantize_rows.default

    def linear(
        self,
        x: torch.Tensor,
        qs: torch.Tensor,
        d: torch.Tensor,
        m: Optional[torch.Tensor],
        out_features: int,
        nbp: int,
        fmt: int,
        layout: int = 0,
        tile_min_rows: int = 1 << 62,
        float32_out: bool = False,
    ) -> torch.Tensor:
        """x [rows, in] contiguous f32/bf16 -> x @ W.T [rows, out_features] in x's dtype: integer dot products
        with int8 activations, or, for bf16 x of at least `tile_min_rows` rows on AVX512-BF16 builds, bf16
        products with tiles of W dequantized once (csrc/quant_dense_bf16.cpp). `float32_out`: in float32 whatever
        x's dtype, by the integer product (logits, without a pass that widens them afterwards: docs/performance.md;
        under torch.compile the product in x's dtype, widened).
        """
        fn = self._function("quant_linear", x.dtype)
        widen = float32_out and x.dtype != torch.float32
        if torch.compiler.is_compiling():
            out = self._linear(x, qs, d, m, out_features, nbp, fmt, layout, 1 << 62 if widen else tile_min_rows, fn)
            return out.float() if widen else out
        # eagerly, the operator's kernel itself: the dispatcher's cost, on each of a step's quantized products,
        # is a share of the step worth saving (docs/performance.md)
        if widen:
            return _quant_linear(x, qs, d, m, out_features, nbp, fmt, layout, 0, self._widening_linear, torch.float32)
        return _quant_linear(x, qs, d, m, out_features, nbp, fmt, layout, tile_min_rows, fn)

    def dequantize(
        self,
        qs: torch.Tensor,
        d: torch.Tensor,
        m: Optional[torch.Tensor],
        out_features: int,
        in_features: int,
        nbp: int,
        fmt: int,
        layout: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The float matrix [out_features, in_features] in `dtype` (f32/bf16)."""
        return self._dequantize(
            qs, d, m, out_features, in_features, nbp, fmt, layout, dtype, self._function("quant_dequantize", dtype)
        )

    def dequantize_rows(
        self,
        qs: torch.Tensor,
        d: torch.Tensor,
        m: Optional[torch.Tensor],
        index: torch.Tensor,
        out_features: int,
        in_features: int,
        nbp: int,
        fmt: int,
        layout: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Rows `index` [n] int64 of the float matrix, [n, in_features] in `dtype` (f32/bf16): an embedding lookup
        without unpacking the layout in torch. IndexError for an index outside [0, out_features)."""
        fn = self._function("quant_dequantize_rows", dtype)
        if torch.compiler.is_compiling():
            return self._dequantize_rows(qs, d, m, index, out_features, in_features, nbp, fmt, layout, dtype, fn)
        return _quant_dequantize_rows(qs, d, m, index, out_features, in_features, nbp, fmt, layout, dtype, fn)

    def _function(self, name: str, dtype: torch.dtype) -> int:
        function = self._functions.get((name, dtype))
        if function is None:
            raise ValueError(f"the quantized products take float32 or bfloat16 activations, not {dtype}")
        return function


def load_quant_kernels(
    cache_dir: Optional[Path] = None, *, march: str = "native", sources: Optional[tuple[str, ...]] = None
) -> QuantKernels:
    """Build (once per machine, target and source) and load the quantized products; raises RuntimeError
    with the reason when no library can be built (there is no torch fallback for quantized weights)."""
    from engine.kernels.cpu import SOURCES, build_library  # (cpu.py imports this module's neighbours)

    try:
        return QuantKernels(build_library(cache_dir, arch=march, sources=sources or SOURCES))
    except (OSError, subprocess.SubprocessError, AttributeError) as error:
        raise RuntimeError(f"the quantized CPU kernels could not be built or loaded: {error}") from error
