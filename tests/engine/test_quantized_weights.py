"""Int8 and int4 weights: their products against a float64 reference of the dequantized matrix (decode
and prefill row counts, odd shapes), the rounding bounds, fusing and the kernel/fallback choice."""

from __future__ import annotations

import pytest
import torch

from engine.quantization.int4_groups import Int4Groups
from engine.quantization.int4_weight import Int4Weight
from engine.quantization import int8_weight
from engine.quantization.int8_weight import Int8Weight
from engine.quantization.weight_quantizer import WeightQuantizer

CPU = torch.device("cpu")
ROWS = (1, 7, 40)  # a decode, a small batch, a prefill chunk
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().t()


def _assert_product(weight, dequantized: torch.Tensor, dtype: torch.dtype, rows: int) -> None:
    x = torch.randn(rows, dequantized.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    out = weight.matmul(x)
    assert out.dtype == dtype and out.shape == (rows, dequantized.shape[0])
    reference = _reference(x, dequantized)
    error = (out.double() - reference).abs().max() / reference.abs().max()
    assert error < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (37, 50)])
def test_int8_product_matches_its_dequantized_matrix(dtype, shape):
    weight = Int8Weight.quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(0)))
    for rows in ROWS:
        _assert_product(weight, weight.dequantize(), dtype, rows)
    # torch's int8 kernel takes decode-sized bf16 products where the width allows (a multiple of 16)
    assert weight.uses_kernel(1, dtype, CPU) == (dtype == torch.bfloat16 and shape[1] % 16 == 0)
    assert not weight.uses_kernel(40, dtype, CPU)
    x = torch.randn(5, shape[1]).to(dtype)
    torch.testing.assert_close(
        weight.matmul(x), weight.matmul_dequantized(x), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 10
    )


def test_one_quantizer_probes_the_int8_kernel_once_for_all_its_matrices(monkeypatch):
    """The probe's answer lives with its owner (the quantizer), not in the module: its matrices share one
    probe per dtype (moved to a device too); a weight made on its own, or by another quantizer, probes anew."""
    probes = []
    monkeypatch.setattr(int8_weight, "_probe", lambda dtype, device: probes.append(dtype) or True)
    quantizer = WeightQuantizer("int8", None, CPU)
    generator = torch.Generator().manual_seed(3)
    weights = [quantizer(torch.randn(32, 64, generator=generator)) for _ in range(3)]
    weights.append(weights[0].to(CPU))
    assert all(w.uses_kernel(1, torch.bfloat16, CPU) for w in weights)
    assert all(w.kernel_check is quantizer.int8_kernel for w in weights)
    assert probes == [torch.bfloat16]
    assert WeightQuantizer("int8", None, CPU)(weights[0].dequantize()).uses_kernel(1, torch.bfloat16, CPU)
    assert Int8Weight.quantize(weights[0].dequantize()).uses_kernel(1, torch.bfloat16, CPU)
    assert probes == [torch.bfloat16] * 3
    assert not hasattr(int8_weight, "_PROBES")


def test_int8_rounding_is_within_half_a_step_per_row():
    w = torch.randn(64, 80, generator=torch.Generator().manual_seed(1))
    weight = Int8Weight.quantize(w)
    step = w.abs().amax(dim=1) / 127
    assert ((weight.dequantize() - w).abs() <= step[:, None] / 2 + 1e-7).all()
    assert weight.qweight.abs().max() == 127
    assert weight.nbytes == 64 * 80 + 64 * 4 and weight.format == "int8"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,group_size,kernel",
    [
        ((96, 128), 32, "cpu"),
        ((64, 576), 128, "cpu"),  # SmolLM's hidden size: 576 is not a multiple of 128, padded to 640
        ((48, 100), 64, "cpu"),
        ((40, 64), 32, "dequantize"),  # out_features not a multiple of 16: no CPU kernel
    ],
)
def test_int4_product_matches_its_dequantized_matrix(dtype, shape, group_size, kernel):
    groups = Int4Groups.quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(2)), group_size)
    weight = Int4Weight(groups, CPU)
    assert weight.kernel == kernel and weight.in_features == shape[1] and weight.out_features == shape[0]
    dequantized = groups.dequantize()
    for rows in ROWS:
        _assert_product(weight, dequantized, dtype, rows)
    torch.testing.assert_close(weight.dequantize(), dequantized, rtol=0, atol=1e-5)
    fallback = Int4Weight(groups, CPU, use_kernel=False)
    x = torch.randn(3, shape[1]).to(dtype)
    torch.testing.assert_close(weight.matmul(x), fallback.matmul(x), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 10)


def test_int4_rounding_keeps_each_group_range():
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(3))
    groups = Int4Groups.quantize(w, 32)
    step = (w.view(32, 3, 32).amax(-1) - w.view(32, 3, 32).amin(-1)) / 15
    error = (groups.dequantize() - w).abs().view(32, 3, 32)
    assert (error <= step[..., None] / 2 + 1e-6).all()
    assert int(groups.codes.max()) == 15 and int(groups.codes.min()) == 0
    weight = Int4Weight(groups, CPU)
    assert weight.format == "int4-g32" and weight.nbytes == 32 * 96 // 2 + 3 * 32 * 2 * 4


def test_int4_fusing_equals_quantizing_the_fused_matrix():
    generator = torch.Generator().manual_seed(4)
    parts = [torch.randn(rows, 64, generator=generator) for rows in (32, 16, 16)]
    fused = Int4Groups.concat([Int4Groups.quantize(p, 32) for p in parts])
    whole = Int4Groups.quantize(torch.cat(parts), 32)
    assert torch.equal(fused.codes, whole.codes)
    torch.testing.assert_close(fused.dequantize(), whole.dequantize())
    with pytest.raises(ValueError, match="share group size"):
        Int4Groups.concat([Int4Groups.quantize(parts[0], 32), Int4Groups.quantize(parts[1], 64)])


def test_int8_refuses_a_malformed_matrix():
    with pytest.raises(ValueError, match="int8"):
        Int8Weight(torch.zeros(4, 4), torch.ones(4))
