"""LoRA steps through the Triton SGMV kernels (what CUDA runs; here on CPU through Triton's interpreter) against
the torch products over the same stacked slots: base tokens, single adapters, a mix, every fused projection."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.lora.lora_stack import FUSED_PROJECTIONS, LoRAKernels, LoRAStack  # noqa: E402
from engine.lora.lora_step import LoRASegment, LoRAStep  # noqa: E402
from tests.lora.adapters import ARCH, random_weights  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_segmented_kernels_match_the_torch_products():
    kernels = LoRAKernels.load()
    assert kernels is not None
    stacks = [
        LoRAStack(ARCH, max_loras=3, max_rank=4, dtype=torch.float32, device=DEVICE, kernels=k) for k in (None, kernels)
    ]
    for stack in stacks:
        stack.load(0, random_weights("x", 4, 0, skip="k_proj"))
        stack.load(2, random_weights("y", 2, 1, skip="up_proj"))
    segments = [
        LoRASegment(0, 1, ((2, 1.0),)),
        LoRASegment(1, 2, ()),
        LoRASegment(3, 3, ((0, 0.5), (2, -1.5))),
        LoRASegment(6, 2, ((0, 1.0),)),
    ]
    torch_step, kernel_step = (LoRAStep.build(stack, 8, segments) for stack in stacks)
    assert torch_step is not None and kernel_step is not None and kernel_step.token_slots is not None
    for proj in FUSED_PROJECTIONS:
        width, outs = stacks[0].shapes[proj]
        x = torch.randn(8, width, device=DEVICE)
        base = torch.randn(8, sum(outs), device=DEVICE)
        expected, got = base.clone(), base.clone()
        torch_step.add(1, proj, x, expected)
        kernel_step.add(1, proj, x, got)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got[1:3], base[1:3])  # base tokens untouched
