"""LoRA steps through the Triton SGMV kernels (what CUDA runs; here on CPU through Triton's interpreter) against
the torch products over the same stacked slots: base tokens, single adapters, a mix, every fused projection."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.lora.lora_graph_inputs import LoRAGraphInputs  # noqa: E402
from engine.lora.lora_stack import LoRAKernels, LoRAStack  # noqa: E402
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
    for proj in stacks[0].layout.fused:
        width, outs = stacks[0].shapes[proj]
        x = torch.randn(8, width, device=DEVICE)
        base = torch.randn(8, sum(outs), device=DEVICE)
        expected, got = base.clone(), base.clone()
        torch_step.add(1, proj, x, expected)
        kernel_step.add(1, proj, x, got)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got[1:3], base[1:3])  # base tokens untouched


def test_a_decode_graphs_static_lora_inputs_refill_in_place():
    """A bucket's static LoRA inputs (what a CUDA graph captures, engine/lora/lora_graph_inputs.py), filled for a
    step of 5 rows in a bucket of 8 after another step's fill: the same tensors, the deltas of an eager step of
    those rows, padding rows with no slot (untouched); through the kernels and the torch products."""
    kernels = LoRAKernels.load()
    segments = [LoRASegment(0, 1, ((2, 1.0),)), LoRASegment(1, 1, ()), LoRASegment(2, 3, ((0, 0.5), (2, -1.5)))]
    for k in (None, kernels):
        stack = LoRAStack(ARCH, max_loras=3, max_rank=4, dtype=torch.float32, device=DEVICE, kernels=k)
        stack.load(0, random_weights("x", 4, 0, skip="k_proj"))
        stack.load(2, random_weights("y", 2, 1, skip="up_proj"))
        inputs = LoRAGraphInputs(stack, 8)
        captured = inputs.step
        views = [captured.scales, *(captured.token_slots or ())]
        inputs.fill([LoRASegment(0, 8, ((1, 2.0),))])  # an earlier step: every row on another slot
        step = inputs.fill(segments)
        assert step is captured and all(a is b for a, b in zip(views, [step.scales, *(step.token_slots or ())]))
        if step.token_slots is not None:
            assert step.token_slots[0][5:].eq(-1).all() and step.token_slots[1][5:].eq(0).all()
        assert step.scales[5:].eq(0).all() and step.scales[1].eq(0).all()
        eager = LoRAStep.build(stack, 5, segments)
        assert eager is not None
        for proj in stack.layout.fused:
            width, outs = stack.shapes[proj]
            x = torch.randn(8, width, device=DEVICE)
            base = torch.randn(8, sum(outs), device=DEVICE)
            expected, got = base[:5].clone(), base.clone()
            eager.add(0, proj, x[:5], expected)
            step.add(0, proj, x, got)
            torch.testing.assert_close(got[:5], expected, rtol=1e-4, atol=1e-4)
            assert torch.equal(got[5:], base[5:]) and torch.equal(got[1], base[1])  # padding and base rows
        assert LoRAGraphInputs.takes(stack, segments)
        stack.embed[2] = torch.zeros(ARCH.vocab_size, ARCH.hidden_size, device=DEVICE)  # modules_to_save: eager
        assert not LoRAGraphInputs.takes(stack, segments)
