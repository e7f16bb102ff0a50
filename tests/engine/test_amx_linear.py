"""The bf16 product for CPUs with AMX tiles (models/amx_linear.py): the native kernel up to 4 rows on the
plain copy, oneDNN beyond on the copy packed for AMX (on CPUs without AMX oneDNN runs the same packed
product on AVX-512, so this runs wherever oneDNN has bf16 products)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.memory_bandwidth import tensor_bytes
from engine.models.amx_linear import AMX_NATIVE_MAX_ROWS, AmxLinear, DualWeight, amx_product_ok
from engine.models.linear import bucketed
from engine.quantization.int8_weight import Int8Weight

pytestmark = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="oneDNN has no bf16 products on this CPU")


def _weights(out_features: int, in_features: int):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * in_features**-0.5).bfloat16()
    return weight, torch.randn(out_features, generator=gen).bfloat16()


@pytest.mark.parametrize("rows", [1, 3, AMX_NATIVE_MAX_ROWS, AMX_NATIVE_MAX_ROWS + 1, 17, 64])
def test_products_follow_the_float64_reference_on_either_copy(cpu_kernels, rows):
    linear = AmxLinear(cpu_kernels)
    weight, bias = _weights(200, 576)
    prepared = linear.prepare(weight)
    assert isinstance(prepared, DualWeight) and prepared.data.data_ptr() == weight.data_ptr()  # no copy of it
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = linear(x, prepared, bias)
    assert got.shape == (rows, 200) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), F.linear(x.double(), weight.double(), bias.double()),
                               atol=2e-2, rtol=2e-2)
    if rows <= AMX_NATIVE_MAX_ROWS:  # which copy: the native kernel's bits up to max_rows, oneDNN's beyond
        assert torch.equal(got, cpu_kernels.gemv(x, weight, bias))
    else:
        assert torch.equal(got, bucketed(linear._packed_product, x, prepared.packed, bias))


def test_quantized_weights_and_mismatched_rows(cpu_kernels):
    linear = AmxLinear(cpu_kernels)
    weight, _ = _weights(64, 96)
    prepared = linear.prepare(weight)
    with pytest.raises(ValueError, match="AMX product"):
        linear(torch.randn(2, 96), prepared, None)
    quantized = linear.prepare(Int8Weight.quantize(weight.float()))
    assert isinstance(quantized, Int8Weight)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(linear(x, quantized, None), quantized.matmul(x))


def test_a_tied_matrix_is_counted_once_and_its_packing_as_extra_memory(cpu_kernels):
    weight, _ = _weights(128, 64)
    dual = AmxLinear(cpu_kernels).prepare(weight)
    assert tensor_bytes([weight, dual]) == tensor_bytes([dual]) == 128 * 64 * 2  # what a step reads
    assert dual.extra_bytes == 128 * 64 * 2


def test_the_load_time_check_passes_here_and_refuses_a_broken_product(monkeypatch):
    assert amx_product_ok()
    monkeypatch.setattr(AmxLinear, "_packed_product", staticmethod(lambda x, packed, bias: torch.zeros(
        x.shape[0], 40, dtype=x.dtype)))
    assert not amx_product_ok()
