"""The batch-invariant product (csrc/invariant_linear.cpp): packing, accuracy, and rows that do not depend on
the batch, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.invariant_linear import BatchInvariantLinear, pack_invariant_weight

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
