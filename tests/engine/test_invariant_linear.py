"""The column-block product (csrc/column_blocks.h): packing, row lookups in the packing, accuracy, rows that do
not depend on the batch, bit for bit (whole blocks and half blocks as work items; the AVX2 and AVX-512 float32
tiles on any x86 machine that runs them), and `ColumnBlockLinear`, the cpu backend's bf16 product on AVX512-BF16
builds and its float32 product on AVX2 and AVX-512 builds (its choice, quantized weights, a tied embedding looked
up in the packed LM head)."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from engine import platform
from engine.platform import cpu_linear
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.kernels.column_block_weight import PackedWeight, pack_invariant_weight
from engine.layers.invariant_linear import ONEDNN_MIN_ROWS, BatchInvariantLinear, ColumnBlockLinear
from engine.layers.linear import GEMV_MAX_ROWS, GemvLinear
from engine.quantization.int8_weight import Int8Weight
from tests.engine.cpu_flags import FLOAT32_TILE_ARCHES, kernels_for

DTYPES = [torch.float32, torch.bfloat16]
# (out_features, in_features): a column tail (N % 64), odd K, the embedded model's down projection (K = 1536,
# where oneDNN's bf16 product rounds one row alone differently from the same row in a batch)
SHAPES = [(64, 32), (130, 67), (200, 1536), (576, 1025)]


@pytest.fixture
def linear(cpu_kernels):
    return BatchInvariantLinear(cpu_kernels)


def weights(out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * in_features**-0.5).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    return weight, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_packing_round_trips(shape, dtype):
    weight, _ = weights(*shape, dtype)
    packed = pack_invariant_weight(weight)
    assert (packed.out_features, packed.in_features) == shape and packed.data.dtype == dtype
    assert packed.data.shape[0] == -(-shape[0] // 64)
    assert torch.equal(packed.unpack(), weight)


def test_packing_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pack_invariant_weight(torch.zeros(4, 4, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_a_float64_product(linear, shape, dtype):
    """Float32 sums of exact products: within float32 rounding of the exact result, then the output dtype's."""
    weight, bias = weights(*shape, dtype)
    x = torch.randn(37, shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    packed = linear.prepare(weight)
    expected = F.linear(x.double(), weight.double(), bias.double())
    for b in (bias, None):
        got = linear(x, packed, b)
        assert got.shape == (37, shape[0]) and got.dtype == dtype
        want = expected if b is not None else expected - bias.double()
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_bits_in_any_batch(linear, dtype, threads):
    """Each row computed alone equals the same row inside batches of every size and offset."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape in SHAPES:
            weight, bias = weights(*shape, dtype, seed=2)
            packed = linear.prepare(weight)
            x = torch.randn(300, shape[1], generator=torch.Generator().manual_seed(3)).to(dtype)
            alone = torch.cat([linear(x[i : i + 1], packed, bias) for i in range(x.shape[0])])
            for start, rows in ((0, 2), (1, 3), (5, 4), (7, 5), (0, 16), (3, 17), (10, 129), (0, 300)):
                got = linear(x[start : start + rows], packed, bias)
                assert torch.equal(got, alone[start : start + rows]), f"{shape}: rows {start}..{start + rows}"
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("arch", list(FLOAT32_TILE_ARCHES))
def test_the_float32_tiles_follow_float64_and_any_batch(arch):
    """float32 on the AVX2 and the AVX-512 tiles (builds for those targets, on any x86 machine that runs them; rows
    split evenly into tiles of up to 6): within float32 rounding of float64, and each row alone the same bits as
    inside batches of every size."""
    kernels = kernels_for(arch, None)
    assert kernels.f32_column_blocks and kernels.invariant_product_ok
    linear = BatchInvariantLinear(kernels)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):  # (whole blocks as work items from 4 blocks a thread: below, half blocks)
            torch.set_num_threads(threads)
            for shape in (*SHAPES, (64 * 10 - 6, 33)):  # 10 blocks with a column tail: whole items on 2 threads
                weight, bias = weights(*shape, torch.float32, seed=5)
                packed = linear.prepare(weight)
                x = torch.randn(150, shape[1], generator=torch.Generator().manual_seed(6))  # 2 chunks of rows
                alone = torch.cat([linear(x[i : i + 1], packed, bias) for i in range(x.shape[0])])
                expected = F.linear(x.double(), weight.double(), bias.double())
                torch.testing.assert_close(alone.double(), expected, atol=1e-5, rtol=1e-5)
                for start, rows in ((0, 2), (1, 7), (3, 8), (0, 13), (5, 19), (0, 40), (0, 150)):
                    got = linear(x[start : start + rows], packed, bias)
                    assert torch.equal(got, alone[start : start + rows]), f"{shape}: rows {start}..{start + rows}"
    finally:
        torch.set_num_threads(previous)


def test_takes_strided_input_and_refuses_mixed_dtypes(linear):
    weight, bias = weights(70, 48, torch.float32)
    packed = linear.prepare(weight)
    x = torch.randn(48, 9).t()  # [9, 48], not contiguous
    torch.testing.assert_close(linear(x, packed, bias), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="share one dtype"):
        linear(x.bfloat16(), packed, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_refuses_inputs_that_do_not_match_the_packed_weight(cpu_kernels, dtype):
    packed = pack_invariant_weight(torch.randn(70, 9).to(dtype)).data
    call = cpu_kernels.invariant_linear
    assert call(torch.randn(3, 9).to(dtype), packed, None, 70).shape == (3, 70)
    with pytest.raises(ValueError, match="packed weight"):
        call(torch.randn(3, 4096).to(dtype), packed, None, 70)  # wrong in_features: would read past the weight
    with pytest.raises(ValueError, match="contiguous 2-D"):
        call(torch.randn(9, 3).to(dtype).t(), packed, None, 70)
    with pytest.raises(ValueError, match="bias"):
        call(torch.randn(3, 9).to(dtype), packed, torch.zeros(7, dtype=dtype), 70)
    assert cpu_kernels.invariant_product_ok


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_are_looked_up_in_the_packing(shape, dtype):
    weight, _ = weights(*shape, dtype)
    packed = pack_invariant_weight(weight)
    ids = torch.tensor([0, shape[0] - 1, 63 % shape[0], shape[0] // 2, 0])
    got = packed.rows(ids)
    assert got.shape == (5, shape[1]) and got.dtype == dtype
    assert torch.equal(got, F.embedding(ids, weight))


def test_the_cpu_backend_takes_column_blocks_where_they_outrun_onednn(cpu_kernels, monkeypatch):
    backend = CpuAttentionBackend(cpu_kernels)
    # float32: column blocks on AVX2 and AVX-512 builds (and never on AMX tiles), else oneDNN's packed product
    linear = cpu_linear(backend, torch.float32)
    if cpu_kernels.f32_column_blocks:
        assert type(linear) is ColumnBlockLinear and linear.amx is False
    else:
        assert linear is None
    monkeypatch.setattr(cpu_kernels, "f32_column_blocks", False)  # a plain x86-64 build
    assert cpu_linear(backend, torch.float32) is None  # oneDNN's packed fp32 product
    monkeypatch.setattr(cpu_kernels, "f32_column_blocks", True)
    monkeypatch.setattr(cpu_kernels, "invariant_product_ok", False)  # a build that failed its self-check
    assert cpu_linear(backend, torch.float32) is None
    monkeypatch.setattr(cpu_kernels, "invariant_product_ok", True)
    column_blocks = ColumnBlockLinear if cpu_kernels.bf16_column_blocks else GemvLinear
    # a CPU with AMX: column blocks where their tile path is built in and granted, else gemv up to 4 rows
    monkeypatch.setattr(platform, "torch_bf16_products_use_amx", lambda: True)
    monkeypatch.setattr(cpu_kernels, "amx_tiles", True)
    assert type(cpu_linear(backend, torch.bfloat16)) is column_blocks
    monkeypatch.setattr(cpu_kernels, "amx_tiles", False)
    linear = cpu_linear(backend, torch.bfloat16)
    assert type(linear) is GemvLinear and linear.max_rows == platform.AMX_GEMV_MAX_ROWS
    # no AMX
    monkeypatch.setattr(platform, "torch_bf16_products_use_amx", lambda: False)
    assert type(cpu_linear(backend, torch.bfloat16)) is column_blocks
    monkeypatch.setattr(cpu_kernels, "invariant_product_ok", False)  # a build that failed its self-check
    linear = cpu_linear(backend, torch.bfloat16)
    assert type(linear) is GemvLinear and linear.max_rows == GEMV_MAX_ROWS
    monkeypatch.setattr(cpu_kernels, "invariant_product_ok", True)
    monkeypatch.setattr(cpu_kernels, "bf16_column_blocks", False)  # an AVX2 or AVX512F-only build
    assert type(cpu_linear(backend, torch.bfloat16)) is GemvLinear


def test_column_block_linear_multiplies_packed_and_quantized_weights(cpu_kernels):
    linear = ColumnBlockLinear(cpu_kernels)
    weight, bias = weights(200, 96, torch.bfloat16)
    packed = linear.prepare(weight)
    assert isinstance(packed, PackedWeight)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4)).bfloat16()
    expected = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(linear(x, packed, bias).double(), expected, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="column-block product"):
        linear(x.float(), packed, None)
    quantized = Int8Weight.quantize(weight.float())
    prepared = linear.prepare(quantized)
    assert isinstance(prepared, Int8Weight)  # its own product, not a packing
    torch.testing.assert_close(linear(x.float(), prepared, None), quantized.matmul(x.float()))


def test_a_product_failing_its_self_check_is_refused(cpu_kernels, monkeypatch, caplog):
    """A miscompiled column-block product: the check says no (the backend then keeps bf16 products off it
    and batch-invariant mode refuses to start)."""
    from engine.kernels.cpu import _invariant_product_ok

    assert _invariant_product_ok(cpu_kernels, torch.Generator().manual_seed(0))
    monkeypatch.setattr(
        cpu_kernels, "invariant_linear", lambda x, weight, bias, n: torch.zeros(x.shape[0], n, dtype=x.dtype)
    )
    assert not _invariant_product_ok(cpu_kernels, torch.Generator().manual_seed(0))
    assert "failed its self-check" in caplog.text


@pytest.mark.parametrize("shape", [(200, 64), (576, 1536), (130, 96), (130, 100)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 130])
def test_the_product_on_amx_tiles_follows_the_float64_reference(cpu_kernels, shape, rows):
    """Whole and half blocks (few or many items per thread), a column tail, partial and whole row groups of 16,
    row chunks of 128; a K that is no multiple of 32 stays on vdpbf16ps (the same bits as without tiles)."""
    if not cpu_kernels.amx_tiles:
        pytest.skip("no AMX tiles here (or their self-check failed)")
    weight, bias = weights(*shape, torch.bfloat16)
    packed = pack_invariant_weight(weight).data
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = cpu_kernels.invariant_linear(x, packed, bias, shape[0], amx=True)
    expected = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)
    if shape[1] % 32:
        assert torch.equal(got, cpu_kernels.invariant_linear(x, packed, bias, shape[0], amx=False))


@pytest.mark.parametrize("amx", [False, True])
def test_column_blocks_hand_prefill_chunks_to_onednn_on_amx(cpu_kernels, amx):
    """From ONEDNN_MIN_ROWS rows on AMX, torch's product on the unpacked weight (a column tail included); the same
    rows without AMX stay on the column-block kernel: both follow the float64 reference."""
    weight, bias = weights(130, 96, torch.bfloat16)
    packed = pack_invariant_weight(weight)
    x = torch.randn(ONEDNN_MIN_ROWS, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = ColumnBlockLinear(cpu_kernels, amx=amx)(x, packed, bias)
    expected = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)
    if amx:
        assert torch.equal(got, F.linear(x, weight, bias))
