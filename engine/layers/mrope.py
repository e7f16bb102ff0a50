"""Multimodal RoPE (M-RoPE: Qwen2-VL, Qwen2.5-VL): a token's position has three components (temporal, height,
width), and each head's rotary pairs are cut into sections, each rotated by one component in turn:

    pairs:     | section 0 (t) | section 1 (h) | section 2 (w) |   (mrope_section, e.g. [16, 24, 24] of 64 pairs)
    angle of pair j = position[component of j's section] * inv_freq[j]

A text token's three components are equal, and then M-RoPE is the ordinary rotation at that position: the runner
serves text and every decode step at that one position, on the ordinary tables (the fused CPU decode step and CUDA
graphs included). Only an image's placeholder rows, whose components differ, take the sectioned rotation: a step
holding some rotates all its rows with tables of its own (`step_tables`), each row's taken from the model's at its
position, an image row's column by column at its section's component.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.rotary import RotaryEmbedding


@dataclass(frozen=True, slots=True)
class SectionedRows:
    """The rows of a step whose position differs per component (an image's placeholders), with their positions."""

    rows: torch.Tensor  # [n] int64: rows of the step
    positions: torch.Tensor  # [n, 3] int64: each row's (temporal, height, width) position


class MultimodalRotary:
    """M-RoPE over a model's rotary tables: which component each rotated dimension takes its angle from."""

    def __init__(self, sections: tuple[int, ...], rope: RotaryEmbedding):
        if sum(sections) != rope.half:
            raise ValueError(
                f"mrope_section {list(sections)} covers {sum(sections)} rotary pairs; a head rotates {rope.half}"
            )
        # (HF cycles the components over the sections: section i takes component i % 3)
        per_pair = torch.cat([torch.full((size,), i % 3, dtype=torch.int64) for i, size in enumerate(sections)])
        self.sections = sections
        self.component = torch.cat([per_pair, per_pair]).to(rope.cos.device)  # [rotary_dim]: cos/sin's two halves

    def step_tables(
        self, rope: RotaryEmbedding, positions: torch.Tensor, sectioned: SectionedRows
    ) -> tuple[RotaryEmbedding, torch.Tensor]:
        """The step's own rotation: tables of one row per step row ([T, rotary_dim]: a text row's at its position,
        a sectioned row's mixed from its components' rows) and the positions that read them (0 .. T - 1)."""
        cos, sin_signed = rope.cos[positions], rope.sin_signed[positions]  # [T, rotary_dim]
        rows = sectioned.rows.to(positions.device)
        # [n, rotary_dim]: the position each column of a sectioned row takes its angle at
        at = sectioned.positions.to(positions.device).index_select(1, self.component)
        columns = torch.arange(rope.rotary_dim, device=positions.device).expand_as(at)
        cos[rows] = rope.cos[at, columns]
        sin_signed[rows] = rope.sin_signed[at, columns]
        steps = torch.arange(positions.shape[0], dtype=torch.int64, device=positions.device)
        return rope.with_tables(cos, sin_signed), steps
