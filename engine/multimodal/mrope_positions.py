"""Where multimodal RoPE (Qwen2-VL, Qwen2.5-VL) places a prompt's images: HF's `get_rope_index` for images,
computed once with the prompt's processing and carried in each ImageInput to the runner.

Text tokens count up one position at a time, all three components equal. An image's placeholders (its merged
patch grid, t x h x w, row-major) sit at (start + t', start + h', start + w') for their grid coordinates, `start`
being the rotary position the image begins at; the text after it continues at start + max(h, w), not at start + the
number of placeholders. So from each image on, text sits at its prompt position plus a shift (negative for any
image of more than one row and column), and decoding continues from the last image's shift (HF's rope_delta):

    prompt positions   0 1 2 [3 4 5 6 7 8] 9 10        an image of 2 x 3 placeholders at 3 .. 8
    temporal           0 1 2  3 3 3 3 3 3  6  7
    height             0 1 2  3 3 3 4 4 4  6  7        shift after it: 3 + max(2, 3) - 9 = -3
    width              0 1 2  3 4 5 3 4 5  6  7
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.errors import InvalidParameterError
from engine.multimodal.inputs import ImageInput


@dataclass(frozen=True, slots=True)
class MRopePositions:
    """A Qwen2-VL-style model's rule: each image's `image_grid_thw` (in patches) merged by `spatial_merge_size`
    on the height and width axes gives its placeholder grid."""

    spatial_merge_size: int

    def place(self, images: tuple[ImageInput, ...], param: str) -> tuple[ImageInput, ...]:
        """The images (in prompt order) with their rotary positions and the shifts of the text after them."""
        placed, shift = [], 0
        for image in images:
            grid = image.data.get("image_grid_thw")
            if grid is None or grid.numel() != 3:
                raise ValueError("multimodal RoPE needs each image's image_grid_thw from the processor")
            if image.positions != tuple(range(image.start, image.end)):
                raise InvalidParameterError(param, "splits an image's placeholder tokens apart")
            rope_positions, advance = self.image_positions(image.start + shift, [int(v) for v in grid.flatten()])
            if rope_positions.shape[0] != image.num_embeds:
                raise ValueError(
                    f"an image grid of {rope_positions.shape[0]} merged patches has {image.num_embeds} placeholders"
                )
            shift += advance - image.num_embeds
            placed.append(dataclasses.replace(image, rope_positions=rope_positions, rope_shift=shift))
        return tuple(placed)

    def image_positions(self, start: int, grid_thw: list[int]) -> tuple[torch.Tensor, int]:
        """[t * h * w, 3] int64: the (temporal, height, width) positions of an image's placeholders that begins at
        rotary position `start`, and how far it advances the rotary position (its grid's larger side)."""
        merge = self.spatial_merge_size
        t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
        axes = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        return torch.stack(axes, dim=-1).reshape(-1, 3) + start, max(h, w)
