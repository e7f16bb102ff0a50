"""How a vision-language family's HF processor lays out a prompt's images in its outputs, so that each image's part
can be cut from them: the dimension that runs over the images' tiles, and what of an image's part is only the
prompt's padding (cut away: an image's tensors, and so its prefix-cache key, are then its own whichever images share
its prompt, as the vision encoder would cut them anyway)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

ImageData = Mapping[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class ImageLayout:
    # the dimension of a processor output that runs over every image's tiles (or over the images): 0, or 1 where a
    # prompt dimension comes first (Idefics3, SmolVLM: pixel_values [prompts, tiles, 3, height, width])
    rows_dim: int = 0
    # (one image's tensors, the HF processor) -> those tensors without the padding the prompt's other images added
    trim: Optional[Callable[[ImageData, Any], dict[str, torch.Tensor]]] = None


def crop_to_image_size(data: ImageData, hf_processor: Any) -> dict[str, torch.Tensor]:
    """Pixtral: pixel_values [1, 3, H, W] padded at the bottom and right to the prompt's largest image, cropped to the
    image's own size (image_sizes [1, 2]: height, width), as Pixtral's encoder crops each image."""
    [(height, width)] = data["image_sizes"].tolist()
    return {**data, "pixel_values": data["pixel_values"][..., :height, :width].contiguous()}


def drop_padding_tiles(data: ImageData, hf_processor: Any) -> dict[str, torch.Tensor]:
    """LLaVA-NeXT, LLaVA-OneVision: pixel_values [1, tiles, 3, s, s] padded with empty tiles to the prompt's most,
    cut to the image's own count as the model counts them (the base image and its anyres grid's tiles, from its
    image_sizes; the base image alone for an image of a multi-image sample, batch_num_images > 1)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    pixel_values = data["pixel_values"]
    batch_num_images = data.get("batch_num_images")
    if batch_num_images is not None and int(batch_num_images.reshape(-1)[0]) != 1:
        tiles = 1
    else:
        tiles = image_size_to_num_patches(
            image_size=data["image_sizes"][0],
            grid_pinpoints=hf_processor.image_processor.image_grid_pinpoints,
            patch_size=pixel_values.shape[-1],  # (a tile's side: the vision tower's image_size)
        )
    return {**data, "pixel_values": pixel_values[:, :tiles].contiguous()}
