"""A step's deltas against their definition: for each token, the sum over its (slot, scale) pairs of
scale * (x A^T) B^T of that slot's adapter, on its slice of the fused projection; packed and raw stacks, and
the native kernels' (csrc/lora_delta.h) in float32 and bfloat16, their A rows grouped by slot or per token."""

from __future__ import annotations

import platform

import pytest
import torch

from engine.kernels.cpu import load_cpu_kernels
from engine.layers.linear import Linear, select_linear
from engine.lora.lora_stack import LoRAStack
from engine.lora.lora_step import LoRASegment, LoRAStep
from tests.lora.adapters import ARCH, random_weights


@pytest.mark.parametrize(
    "kind, dtype",
    [
        ("raw", torch.float32),
        ("packed", torch.float32),
        ("native", torch.float32),
        ("native", torch.bfloat16),
        ("native-haswell", torch.bfloat16),  # the AVX2 code paths (built for tests/engine/test_fused_decode.py too)
    ],
)
def test_deltas_match_their_definition(kind, dtype, request):
    packed = kind == "packed"
    linear = select_linear(torch.device("cpu"), torch.float32) if packed else None
    if packed and type(linear) is Linear:
        pytest.skip("no packing product on this CPU build")  # (then the engine runs the raw path too)
    native = request.getfixturevalue("cpu_kernels") if kind == "native" else None
    if kind == "native-haswell":
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("-march=haswell is an x86 target")
        request.getfixturevalue("cpu_kernels")  # (skips without a compiler)
        native = load_cpu_kernels(arch="haswell")
    stack = LoRAStack(
        ARCH, max_loras=3, max_rank=4, dtype=dtype, device=torch.device("cpu"), linear=linear, native=native
    )
    adapters = {1: random_weights("x", 4, 0, skip="k_proj"), 2: random_weights("y", 2, 1, skip="up_proj")}
    for slot, adapter in adapters.items():
        stack.load(slot, adapter)
    # tokens 0-1 base, 2-4 slot 1, 5 a mix of both, 6-7 slot 2
    segments = [
        LoRASegment(0, 2, ()),
        LoRASegment(2, 3, ((1, 1.0),)),
        LoRASegment(5, 1, ((1, 0.3), (2, -0.7))),
        LoRASegment(6, 2, ((2, 2.0),)),
    ]
    step = LoRAStep.build(stack, 8, segments)
    assert step is not None and step.fusable == (native is not None)
    for proj, parts in stack.layout.fused.items():
        width, outs = stack.shapes[proj]
        x = torch.randn(8, width).to(dtype)
        out = torch.zeros(8, sum(outs), dtype=dtype)
        step.add(1, proj, x, out)
        if native is not None:  # each token reading its own A rows gives the same sums
            per_token = torch.zeros_like(out)
            a, b = stack.a[1][proj], stack.b[1][proj]
            native.lora_add_(x, per_token, a, b, *step.native_slots, stack.ranks, outs, grouped=False)
            assert torch.equal(per_token, out)
        x = x.float()
        expected = torch.zeros_like(out, dtype=torch.float32)
        for start, length, slots in segments:
            for slot, scale in slots:
                column = 0
                for part, out_width in zip(parts, outs):
                    adapter = adapters[slot]
                    if (1, part) in adapter.a:
                        lora_a, lora_b = adapter.a[(1, part)].to(dtype).float(), adapter.b[(1, part)].to(dtype).float()
                        delta = x[start : start + length] @ lora_a.t() @ lora_b.t()
                        expected[start : start + length, column : column + out_width] += scale * delta
                    column += out_width
        tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(out.float(), expected, **tolerance)
