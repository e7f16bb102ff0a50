"""The image half of a Qwen2-VL-style processor, for where transformers cannot build the checkpoint's whole
processor: Qwen2-VL's and Qwen2.5-VL's take a video processor that needs torchvision, whatever the prompts hold,
and torchvision is no dependency here (nor does PyPI's build load beside torch's CPU build). It is composed of the
checkpoint's own tokenizer and image processor (AutoImageProcessor: without torchvision, its Pillow build) and
expands each image placeholder as HF's processor does: once per merged patch of the image's grid
(`image_grid_thw`'s product over `merge_size`²)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


class ImageOnlyProcessor:
    """Called as the HF processor is (`text=[...]`, `images=[...]`, `return_tensors="pt"`), for images only."""

    def __init__(self, tokenizer: Any, image_processor: Any, image_token: str):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = image_token

    @staticmethod
    def takes(image_processor: Any) -> bool:
        """Whether an image processor sizes images by a patch grid this expansion reads (Qwen2-VL's)."""
        return isinstance(getattr(image_processor, "merge_size", None), int)

    def __call__(
        self,
        text: Sequence[str],
        images: Optional[Sequence[Any]] = None,
        return_tensors: str = "pt",
        add_special_tokens: bool = False,
    ) -> dict[str, torch.Tensor]:
        [prompt] = text
        out: dict[str, torch.Tensor] = {}
        pieces = prompt.split(self.image_token)
        if images:
            out.update(self.image_processor(list(images), return_tensors="pt"))
            merged = self.image_processor.merge_size**2
            counts = [int(n) // merged for n in out["image_grid_thw"].prod(-1)]
            if len(counts) != len(pieces) - 1:
                raise ValueError(f"{len(pieces) - 1} image placeholders for {len(counts)} images")
            prompt = pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))
        elif len(pieces) > 1:
            raise ValueError(f"{len(pieces) - 1} image placeholders and no image")
        out["input_ids"] = self.tokenizer([prompt], add_special_tokens=add_special_tokens, return_tensors="pt")[
            "input_ids"
        ]
        return out
