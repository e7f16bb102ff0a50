"""The native small-batch product (csrc/gemv.cpp) against a float64 reference, for every instruction-set
path this machine can run (the native build, AVX2 and plain x86-64 builds into their own cache keys), and
`GemvLinear` choosing it by row count."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import NATIVE_ARCH, load_cpu_kernels
from engine.layers.linear import GEMV_MAX_ROWS, GemvLinear

X86_ARCHES = ("haswell", "x86-64")  # AVX2 + FMA; SSE2 only (the scalar code)
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 8e-3}
"""Error bound relative to sum_k |x_k w_k|: float32 accumulation, and for bf16 the output's rounding."""


@pytest.fixture(scope="module", params=(NATIVE_ARCH, *X86_ARCHES))
def arch_kernels(request, cpu_kernels):
    if request.param == NATIVE_ARCH:
        return cpu_kernels
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"-march={request.param} is an x86 target")
    kernels = load_cpu_kernels(arch=request.param)
    assert kernels is not None, f"the -march={request.param} build failed"
    return kernels


def _check(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    reference = x.double() @ weight.double().t()  # [rows, out]
    scale = x.double().abs() @ weight.double().abs().t()
    if bias is not None:
        reference += bias.double()
        scale += bias.double().abs()
    error = (got.double() - reference).abs()
    bound = TOLERANCE[x.dtype] * scale + 1e-30
    assert got.shape == reference.shape and got.dtype == x.dtype
    assert bool((error <= bound).all()), f"worst error / bound {float((error / bound).max()):.2f}"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("out_features, in_features", ((1, 1), (7, 33), (64, 576), (130, 95), (19, 1000)))
def test_matches_float64_for_rows_1_to_8(arch_kernels, dtype, out_features, in_features):
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    for rows in range(1, GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        _check(arch_kernels.gemv(x, weight, None), x, weight, None)
        _check(arch_kernels.gemv(x, weight, bias), x, weight, bias)


def test_large_shape_threads_split_rows(cpu_kernels):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(3075, 576, generator=generator).bfloat16()  # a tail past the last group of 4
    x = torch.randn(3, 576, generator=generator).bfloat16()
    _check(cpu_kernels.gemv(x, weight, None), x, weight, None)


def test_rejects_mismatched_arguments(cpu_kernels):
    weight = torch.randn(8, 16)
    with pytest.raises(ValueError):
        cpu_kernels.gemv(torch.randn(2, 15), weight, None)
    with pytest.raises(ValueError):
        cpu_kernels.gemv(torch.randn(2, 16).bfloat16(), weight, None)
    with pytest.raises(ValueError):
        cpu_kernels.gemv(torch.randn(2, 16), weight.t().contiguous().t(), None)
    with pytest.raises(ValueError):
        cpu_kernels.gemv(torch.randn(2, 16), weight, torch.randn(7))


def test_gemv_linear_takes_small_batches_and_leaves_large_ones_to_torch(cpu_kernels, monkeypatch):
    linear = GemvLinear(cpu_kernels)
    generator = torch.Generator().manual_seed(2)
    weight = linear.prepare(torch.randn(40, 24, generator=generator).bfloat16())
    bias = torch.randn(40, generator=generator).bfloat16()
    calls = []
    native = cpu_kernels.gemv
    monkeypatch.setattr(cpu_kernels, "gemv", lambda *args: calls.append(args[0].shape[0]) or native(*args))
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 24, generator=generator).bfloat16()
        _check(linear(x, weight, bias), x, weight, bias)
    assert calls == [1, GEMV_MAX_ROWS]


def test_gemv_linear_is_traced_by_torch_compile(cpu_kernels):
    linear = GemvLinear(cpu_kernels)
    weight = torch.randn(32, 16).bfloat16()
    x = torch.randn(2, 16).bfloat16()
    compiled = torch.compile(lambda a: linear(a, weight, None), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), F.linear(x, weight), rtol=1e-2, atol=1e-2)
