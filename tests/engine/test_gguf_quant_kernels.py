"""The GGUF block-format products (csrc/quant_gemm.cpp) against float64 references of gguf's own
dequantization, for every format, both layouts (row-major, and 16 rows interleaved: gguf_formats.py's X16),
every compiled path (this machine's, AVX2 via -march=haswell, scalar via -march=x86-64), odd shapes,
1..70 activation rows, float32 and bfloat16 activations.

Two references per product:
  tight  the activations quantized to int8 per 32-block exactly as the kernel does (emulated here in
         numpy), times gguf's dequantized weights, in float64: only float rounding may differ;
  float  the activations as given: the difference must stay within the bound the activation
         quantization allows (half a step per element, sum_j |w_ij| dx_j / 2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.kernels.cpu import compiler
from engine.kernels.quant import QUANT_SOURCES, load_quant_kernels
from engine.quantization.gguf_formats import FORMATS, X16, padded_blocks, repack
from engine.quantization.gguf_weight import (
    AMX_DENSE_MIN_ROWS,
    BF16_DENSE_MIN_ROWS,
    DENSE_MIN_ROWS,
    TILE_MIN_ROWS,
    X16_TILE_MIN_ROWS,
    GgufWeight,
    bf16_dense_min_rows,
)
from tests.engine.cpu_flags import cpu_has

TYPES = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
SHAPES = [(1, 32), (5, 96), (17, 160), (33, 576), (70, 1536)]  # [out, in]: odd block counts, column tails
X16_SHAPES = [(16, 32), (48, 96), (32, 160), (64, 576), (80, 1536)]  # out a multiple of 16, odd block counts
LAYOUT_SHAPES = {"rows": SHAPES, "x16": X16_SHAPES}
ROWS = (1, 3, 4, 5, 8, 17, 70)
TARGETS = {"native": "this CPU", "haswell": "AVX2 + FMA + F16C", "x86-64": "scalar"}


@pytest.fixture(scope="module", params=list(TARGETS))
def kernels(request):
    if compiler() is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    if request.param == "haswell" and not cpu_has("avx2", "fma", "f16c"):
        pytest.skip("this CPU cannot run AVX2 code")
    return load_quant_kernels(march=request.param, sources=QUANT_SOURCES)


@pytest.fixture(scope="module")
def weights():
    """(format, shape) -> (raw GGUF blocks, gguf's float64 dequantization [out, in])."""
    rng = np.random.default_rng(11)
    made = {}
    for name, qtype in TYPES.items():
        for out_features, in_features in SHAPES + X16_SHAPES:
            w = rng.standard_normal((out_features, in_features)).astype(np.float32)
            w[:, :32] *= 8.0  # one block per row with larger weights: scales differ per block
            raw = quantize(w, qtype)
            made[name, (out_features, in_features)] = raw, dequantize(raw, qtype).astype(np.float64)
    return made


def quantized_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [rows, K] -> (the kernel's int8 activations times their scales, float64 [rows, K]; the
    scales dx [rows, K], one per element's block), computed with the kernel's float32 operations."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(blocks * inverse)
    dx = (amax / np.float32(127.0)).astype(np.float32)
    return (q.astype(np.float64) * dx.astype(np.float64)).reshape(rows, k), np.broadcast_to(dx, blocks.shape).reshape(
        rows, k
    ).astype(np.float64)


def make_x(rows: int, in_features: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    x[:, 3] *= 20.0  # an outlier channel, as hidden states have
    return x.to(dtype)


def check_integer_product(got: torch.Tensor, x: torch.Tensor, reference: np.ndarray) -> None:
    x32 = x.float().numpy()
    x_quantized, dx = quantized_activations(x32)
    exact = x_quantized @ reference.T
    magnitude = np.abs(x_quantized) @ np.abs(reference).T
    rounding = 1e-5 * magnitude + (2.0**-8 * np.abs(exact) if got.dtype == torch.bfloat16 else 0.0) + 1e-6
    np.testing.assert_array_less(np.abs(got.double().numpy() - exact), rounding)
    plain = x32.astype(np.float64) @ reference.T
    bound = np.abs(reference) @ (dx / 2).T  # [out, rows]: half a quantization step per element
    assert np.all(np.abs(exact - plain) <= bound.T * (1 + 1e-6) + 1e-9)


def make_weight(kernels, weights, name: str, shape: tuple[int, int], layout: str = "rows") -> GgufWeight:
    raw, _ = weights[name, shape]
    w = GgufWeight(FORMATS[name], repack(FORMATS[name], raw, shape[1]), shape[1], kernels)
    return w.interleaved() if layout == "x16" else w


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("shape", SHAPES + X16_SHAPES, ids=str)
def test_dequantize_is_ggufs(kernels, weights, name, shape):
    _, reference = weights[name, shape]
    w = make_weight(kernels, weights, name, shape)
    assert (w.out_features, w.in_features, w.format) == (*shape, name)
    interleaved = w.interleaved()
    assert (interleaved.packed.layout == X16) == (shape[0] % 16 == 0)  # else the row layout stays
    assert interleaved.nbytes <= w.nbytes  # the same blocks (no padding block)
    for weight in (w, interleaved):
        assert weight.out_features == shape[0]
        np.testing.assert_array_equal(weight.dequantize(torch.float32).double().numpy(), reference)
        expected_bf16 = torch.from_numpy(reference).to(torch.bfloat16)
        assert torch.equal(weight.dequantize(torch.bfloat16), expected_bf16)


@pytest.mark.parametrize("name", list(TYPES))
def test_x16_records_hold_their_blocks_scales(kernels, weights, name):
    """X16 stores each block's quants, its 16 columns' scales, then (Q4_1) their minimums, one record after
    another: a group is one stream. d and m are views into those records, so the weight's bytes count once."""
    shape = (48, 96)
    rows = make_weight(kernels, weights, name, shape)
    x16 = rows.interleaved().packed
    fmt, nb = FORMATS[name], shape[1] // 32
    quant_bytes = 16 * fmt.qs_bytes_per_block()
    record = quant_bytes + 32 * (2 if fmt.has_min else 1)
    assert x16.qs.shape == (shape[0] // 16, nb * record) and x16.qs.is_contiguous()
    records = x16.qs.view(shape[0] // 16, nb, record)
    for scales, stored in ((x16.d, rows.packed.d), (x16.m, rows.packed.m)):
        if stored is None:
            assert scales is None
            continue
        assert scales.shape == (shape[0] // 16, nb, 16) and scales.untyped_storage().data_ptr() == x16.qs.data_ptr()
        expected = stored[:, :nb].reshape(-1, 16, nb).transpose(1, 2)  # [group, block, column]
        assert torch.equal(scales, expected)
        offset = quant_bytes if scales is x16.d else quant_bytes + 32
        assert torch.equal(records[:, :, offset : offset + 32].view(torch.float16), expected)
    padding = (rows.packed.nbp - nb) * shape[0] * (fmt.qs_bytes_per_block() + 2 * (2 if fmt.has_min else 1))
    assert rows.interleaved().nbytes == rows.nbytes - padding


@pytest.mark.parametrize("layout", list(LAYOUT_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(TYPES))
def test_integer_product_every_shape_and_row_count(kernels, weights, name, dtype, layout):
    for got, x, reference in each_product(kernels, weights, name, dtype, layout):
        assert got.shape == (x.shape[0], reference.shape[0]) and got.dtype == dtype
        check_integer_product(got, x, reference)


@pytest.mark.parametrize("layout", list(LAYOUT_SHAPES))
@pytest.mark.parametrize("name", list(TYPES))
def test_float32_out_of_bf16_activations_is_the_unrounded_integer_product(kernels, weights, name, layout):
    """Logits: bf16 rows, float32 out with no bf16 rounding between (the float32-activation product of the
    same values, bit for bit), and the bf16 product is that result rounded."""
    for shape in LAYOUT_SHAPES[layout]:
        _, reference = weights[name, shape]
        w = make_weight(kernels, weights, name, shape, layout)
        p = w.packed
        for rows in ROWS:
            x = make_x(rows, shape[1], torch.bfloat16, seed=rows)
            got = kernels.linear(x, p.qs, p.d, p.m, w.out_features, p.nbp, w.fmt.code, p.layout, float32_out=True)
            assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
            check_integer_product(got, x, reference)
            widened = kernels.linear(x.float(), p.qs, p.d, p.m, w.out_features, p.nbp, w.fmt.code, p.layout)
            assert torch.equal(got, widened)
            rounded = kernels.linear(x, p.qs, p.d, p.m, w.out_features, p.nbp, w.fmt.code, p.layout)
            assert torch.equal(got.bfloat16(), rounded)
            assert torch.equal(
                w.matmul_float32(x), got if w.product(rows, x.dtype) == "integer" else w.matmul(x).float()
            )


def each_product(kernels, weights, name: str, dtype: torch.dtype, layout: str, **options):
    """(product, activations, float64 reference weight) for every shape and row count of format `name`."""
    for shape in LAYOUT_SHAPES[layout]:
        _, reference = weights[name, shape]
        w = make_weight(kernels, weights, name, shape, layout)
        p = w.packed
        for rows in ROWS:
            x = make_x(rows, shape[1], dtype, seed=rows)
            yield (
                kernels.linear(x, p.qs, p.d, p.m, w.out_features, p.nbp, w.fmt.code, p.layout, **options),
                x,
                reference,
            )


@pytest.mark.parametrize("layout", list(LAYOUT_SHAPES))
@pytest.mark.parametrize("name", ["q4_0", "q4_1"])
def test_four_bit_products_at_the_edge_of_their_16_bit_sums(kernels, name, layout):
    """Every quant 15 (or nearly) against activations quantized to +-127: a block's vpmaddubsw pair sums add up to
    near 8 x 3,810 in 16 bits on AVX2 before they are widened; the products stay the exact integer ones."""
    shape = LAYOUT_SHAPES[layout][-1]
    w = np.ones(shape, dtype=np.float32)
    w[:, ::32] = 0.0 if name == "q4_1" else -1.0  # each block's extreme: its other quants are 15
    raw = quantize(w, TYPES[name])
    reference = dequantize(raw, TYPES[name]).astype(np.float64)
    weight = GgufWeight(FORMATS[name], repack(FORMATS[name], raw, shape[1]), shape[1], kernels)
    weight = weight.interleaved() if layout == "x16" else weight
    p = weight.packed
    for rows in (1, 2, 4, 5):
        x = torch.ones(rows, shape[1]) * torch.tensor([1.0, -1.0, 3.0, -0.5, 2.0])[:rows, None]
        got = kernels.linear(x, p.qs, p.d, p.m, weight.out_features, p.nbp, weight.fmt.code, p.layout)
        check_integer_product(got, x, reference)
        assert np.abs(got.double().numpy()).max() > 0.9 * np.abs(x.double().numpy() @ reference.T).max()


@pytest.mark.parametrize("layout", list(LAYOUT_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_nan_activation_makes_its_rows_products_nan(kernels, weights, dtype, layout):
    """A NaN in an activation row (one element, or the whole row: a model's overflow after a norm) makes every
    product of that row NaN, as float64's are, in each product a row can take (integer, float32 logits, bf16
    tiles), so that it reaches the engine's check of the logits; the other rows keep their values. (The
    activations' quantization left a NaN out: a one-NaN row came out finite, an all-NaN row all 0.)"""
    for name in TYPES:
        w = make_weight(kernels, weights, name, LAYOUT_SHAPES[layout][2], layout)
        p = w.packed
        x = make_x(4, w.in_features, dtype, seed=5)
        x[1, 37] = float("nan")
        x[3] = float("nan")
        options = [{}, {"float32_out": True}, {"tile_min_rows": 1}] if dtype == torch.bfloat16 else [{}]
        for option in options:
            got = kernels.linear(x, p.qs, p.d, p.m, w.out_features, p.nbp, w.fmt.code, p.layout, **option)
            assert got[[1, 3]].isnan().all(), (name, option)
            clean = x[[0, 2]].contiguous()
            expected = kernels.linear(clean, p.qs, p.d, p.m, w.out_features, p.nbp, w.fmt.code, p.layout, **option)
            assert torch.equal(got[[0, 2]], expected), (name, option)


def check_float_product(got: torch.Tensor, x: torch.Tensor, reference: np.ndarray, relative: float) -> None:
    """Within `relative` of the sum of absolute products (bf16 rounding of weights or of the result)."""
    xs = x.double().numpy()
    exact = xs @ reference.T
    tolerance = relative * (np.abs(xs) @ np.abs(reference).T) + 1e-6
    np.testing.assert_array_less(np.abs(got.double().numpy() - exact), tolerance)


@pytest.mark.parametrize("layout", list(LAYOUT_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(TYPES))
def test_bf16_tile_product_every_shape_and_row_count(kernels, weights, name, dtype, layout):
    """Tiles of the weight dequantized to bf16, activations in bf16 (AVX512-BF16 builds, row layout;
    elsewhere the same call falls back to the integer product)."""
    for got, x, reference in each_product(kernels, weights, name, dtype, layout, tile_min_rows=1):
        if kernels.bf16_tiles:
            check_float_product(got, x, reference, 2.0**-7)
        else:
            check_integer_product(got, x, reference)


@pytest.mark.parametrize("layout", list(LAYOUT_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matmul_picks_its_product_by_rows(kernels, weights, dtype, layout):
    shape = (33, 576) if layout == "rows" else (64, 576)
    _, reference = weights["q4_1", shape]
    w = make_weight(kernels, weights, "q4_1", shape, layout)
    if not kernels.bf16_tiles:
        tiles = DENSE_MIN_ROWS[dtype]
    elif dtype == torch.bfloat16 and layout == "x16":
        tiles = X16_TILE_MIN_ROWS
    elif layout == "x16":  # float32 activations on X16: integer products, then dense ones
        tiles = DENSE_MIN_ROWS[dtype]
    else:
        tiles = TILE_MIN_ROWS
    dense = DENSE_MIN_ROWS[dtype] if dtype == torch.float32 or not kernels.bf16_tiles else None
    if dtype == torch.bfloat16 and kernels.bf16_tiles:  # bf16 prefill on oneDNN
        dense = bf16_dense_min_rows(kernels)
        assert dense == (AMX_DENSE_MIN_ROWS if kernels.amx_dense else BF16_DENSE_MIN_ROWS)
    for rows in sorted({1, tiles - 1, tiles, tiles + 5, *((dense - 1, dense, dense + 3) if dense else ())}):
        x = make_x(rows, 576, dtype, seed=rows)
        assert w.product(rows, dtype) in ("integer", "tiles", "dense")
        got = w.matmul(x)
        if rows < tiles:
            assert w.product(rows, dtype) == "integer"
            check_integer_product(got, x, reference)
        elif dense is not None and rows >= dense:  # torch's product on the dequantized weight
            assert w.product(rows, dtype) == "dense"
            check_float_product(got, x, reference, 1e-5 if dtype == torch.float32 else 2.0**-7)
        else:  # bf16 tiles
            assert w.product(rows, dtype) == "tiles"
            check_float_product(got, x, reference, 2.0**-7)


def test_rows_concat_and_take_are_exact(kernels, weights):
    raw, reference = weights["q8_0", (70, 1536)]
    w = GgufWeight(FORMATS["q8_0"], repack(FORMATS["q8_0"], raw, 1536), 1536, kernels)
    index = torch.tensor([69, 0, 5, 5, 33])
    np.testing.assert_array_equal(w.rows(index, torch.float32).double().numpy(), reference[index.numpy()])
    raw4, reference4 = weights["q4_1", (5, 96)]
    part = GgufWeight(FORMATS["q4_1"], repack(FORMATS["q4_1"], raw4, 96), 96, kernels)
    fused = GgufWeight.concat_rows([part, part.take_rows(torch.tensor([4, 3, 2, 1, 0]))])
    expected = np.concatenate([reference4, reference4[::-1]])
    np.testing.assert_array_equal(fused.dequantize().double().numpy(), expected)
    assert fused.nbytes == 2 * part.nbytes
    with pytest.raises(ValueError, match="different formats"):
        GgufWeight.concat_rows([part, w])
    for name, shape in (("q8_0", (80, 1536)), ("q4_1", (64, 576)), ("q4_0", (48, 96))):  # X16: rows taken back
        interleaved = make_weight(kernels, weights, name, shape, "x16")
        index = torch.tensor([shape[0] - 1, 0, 17, 17, 5])
        np.testing.assert_array_equal(
            interleaved.rows(index, torch.float32).double().numpy(), weights[name, shape][1][index.numpy()]
        )
        taken = interleaved.take_rows(index)  # out of the X16 records, back to the row layout (rows_of_x16)
        assert taken.packed.layout != X16
        np.testing.assert_array_equal(taken.dequantize().double().numpy(), weights[name, shape][1][index.numpy()])
        with pytest.raises(ValueError, match="before they are interleaved"):
            GgufWeight.concat_rows([interleaved, interleaved])


@pytest.mark.parametrize("layout", list(LAYOUT_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(TYPES))
def test_rows_are_the_dequantized_matrix_rows(kernels, weights, name, dtype, layout):
    """The embedding lookup's native row gather: bit for bit the rows of the whole dequantized matrix, in either
    layout, repeats and any order; an index outside the matrix is an IndexError, never a read past it."""
    for shape in LAYOUT_SHAPES[layout]:
        w = make_weight(kernels, weights, name, shape, layout)
        whole = w.dequantize(dtype)
        index = torch.tensor([shape[0] - 1, 0, shape[0] // 2, shape[0] // 2, min(1, shape[0] - 1)])
        got = w.rows(index, dtype)
        assert got.dtype == dtype and got.shape == (5, shape[1])
        assert torch.equal(got, whole[index])
        assert w.rows(index[:0], dtype).shape == (0, shape[1])
        for bad in (shape[0], -1):
            with pytest.raises(IndexError, match="outside"):
                w.rows(torch.tensor([0, bad]), dtype)


def test_bytes_read_are_the_blocks_and_scales(kernels, weights):
    raw, _ = weights["q4_1", (33, 576)]
    w = GgufWeight(FORMATS["q4_1"], repack(FORMATS["q4_1"], raw, 576), 576, kernels)
    assert w.nbytes == raw.nbytes  # 18 blocks of 20 bytes per row: nothing padded at an even block count
    assert padded_blocks(96) == 4 and padded_blocks(576) == 18
    with pytest.raises(ValueError, match="multiple of 32"):
        padded_blocks(100)


def test_the_operator_passes_torch_library_checks(weights):
    if compiler() is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    kernels = load_quant_kernels(sources=QUANT_SOURCES)
    raw, _ = weights["q4_0", (17, 160)]
    w = GgufWeight(FORMATS["q4_0"], repack(FORMATS["q4_0"], raw, 160), 160, kernels)
    p = w.packed
    x = make_x(3, 160, torch.float32, seed=0)
    function = kernels._function("quant_linear", torch.float32)
    torch.library.opcheck(
        torch.ops.pagedserve.cpu_quant_linear.default,
        (x, p.qs, p.d, p.m, 17, p.nbp, w.fmt.code, p.layout, 1 << 40, function),
        test_utils=("test_schema", "test_faketensor"),
    )
    rows = kernels._function("quant_dequantize_rows", torch.float32)
    torch.library.opcheck(
        torch.ops.pagedserve.cpu_quant_dequantize_rows.default,
        (p.qs, p.d, p.m, torch.tensor([3, 0, 16]), 17, 160, p.nbp, w.fmt.code, p.layout, torch.float32, rows),
        test_utils=("test_schema", "test_faketensor"),
    )
