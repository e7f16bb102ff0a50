"""The fused native layer ops against the torch ones (same contract, float32 rounding apart)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.layer_ops import NativeLayerOps, TorchLayerOps
from engine.layers.rotary import RotaryEmbedding

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture
def ops(cpu_kernels):
    return NativeLayerOps(cpu_kernels), TorchLayerOps()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 crosses the kernels' threading threshold
def test_norms_and_activation(ops, dtype, rows):
    native, reference = ops
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = torch.rand(576, generator=gen).to(dtype)
    gate_up = (torch.randn(rows, 2 * 200, generator=gen) * 4).to(dtype)

    torch.testing.assert_close(native.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), **TOL[dtype])

    expected_out, expected_residual = reference.add_rms_norm(x, residual.clone(), weight, 1e-5)
    native_residual = residual.clone()
    out, returned = native.add_rms_norm(x, native_residual, weight, 1e-5)
    assert returned is native_residual  # updated in place
    torch.testing.assert_close(native_residual, expected_residual, **TOL[dtype])
    torch.testing.assert_close(out, expected_out, **TOL[dtype])

    torch.testing.assert_close(native.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **TOL[dtype])
    torch.testing.assert_close(native.gelu_tanh_and_mul(gate_up), reference.gelu_tanh_and_mul(gate_up), **TOL[dtype])


def test_silu_and_gelu_saturate_cleanly(ops):
    native, reference = ops
    gate_up = torch.tensor([[-200.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 200.0] + [1.0] * 7])
    torch.testing.assert_close(native.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    torch.testing.assert_close(native.gelu_tanh_and_mul(gate_up), reference.gelu_tanh_and_mul(gate_up))


def test_gelu_tanh_against_float64(cpu_kernels):
    """The native GeGLU (g * sigmoid(2 y), csrc/row_ops.h) against HF's tanh form in float64."""
    kernels = cpu_kernels
    gate = torch.linspace(-12, 12, 4001)
    up = torch.ones_like(gate)
    got = kernels.gelu_tanh_and_mul(torch.cat([gate, up])[None]).double()[0]
    g = gate.double()
    expected = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 48])  # 48: partial rotary, the last 16 dimensions of a head pass
def test_rotary_in_place_on_strided_rows(ops, dtype, rotary_dim):
    """q and k heads rotated inside the fused qkv buffer; v heads untouched."""
    native, reference = ops
    heads, kv_heads, head_dim = 6, 2, 64
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype, torch.device("cpu"), rotary_dim)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 100, 1000, 4095, 3, 3])
    expected = reference.rotary(qkv[:, : heads + kv_heads], reference.rotary_angles(positions, rope), rope)
    values = qkv[:, heads + kv_heads :].clone()
    qkv_before = qkv[:, : heads + kv_heads].clone()
    got = native.rotary(qkv[:, : heads + kv_heads], native.rotary_angles(positions, rope), rope)
    assert got.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(got, expected, **TOL[dtype])
    if rotary_dim < head_dim:
        assert not torch.equal(got[..., :rotary_dim], qkv_before[: len(got), ..., :rotary_dim])
        assert torch.equal(got[..., rotary_dim:], qkv_before[..., rotary_dim:])
    assert torch.equal(qkv[:, heads + kv_heads :], values)
