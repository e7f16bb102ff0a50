"""A prompt's images as the runner reads them: each image's encoder inputs and the prompt positions its
embeddings fill. Built by the processor (processor.py), carried opaque through the scheduler in the step
message, so a worker process gets them with the request and needs nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from scheduler.block_hash import MediaSpan


@dataclass(frozen=True, slots=True, eq=False)
class ImageInput:
    """One image of a prompt.

    `data`: the processor's outputs for this image alone (pixel_values and whatever else the model's vision
    encoder takes, each with the image's rows only); `positions`: the prompt positions its embeddings replace,
    in order (its placeholder tokens: the encoder returns one embedding per position); `key`: a digest of `data`,
    which is what the encoder sees, so equal keys mean equal embeddings (the prefix cache's key for the image).

    Multimodal RoPE (Qwen2-VL; None and 0 otherwise): `rope_positions`, each placeholder's (temporal, height,
    width) rotary position; `rope_shift`, what the rotary position of a token after the image differs from its
    prompt position by (this image's and every earlier one's: an image of n placeholders advances the rotary
    position by its grid's larger side, not by n). Both follow from the prompt and the images' grids, which `key`
    digests, so blocks whose hashes match have the same rotary positions."""

    data: Mapping[str, torch.Tensor]
    positions: tuple[int, ...]
    key: bytes
    rope_positions: Optional[torch.Tensor] = None  # [num_embeds, 3] int64
    rope_shift: int = 0

    @property
    def start(self) -> int:
        return self.positions[0]

    @property
    def end(self) -> int:
        """One past its last placeholder position."""
        return self.positions[-1] + 1

    @property
    def num_embeds(self) -> int:
        return len(self.positions)


@dataclass(frozen=True, slots=True, eq=False)
class MultiModalInputs:
    """A prompt's images, in prompt order (their spans do not overlap).

    `bidirectional`: each image's tokens attend to each other both ways during the prompt (Gemma 3), everything
    else causally; then each image's positions are contiguous, and every step computes an image whole
    (scheduler/bidirectional_spans.py) and tells the attention backend which of its rows those are."""

    images: tuple[ImageInput, ...]
    bidirectional: bool = False

    @property
    def spans(self) -> tuple[MediaSpan, ...]:
        """Each image's (start, end, key): what the scheduler digests into the hashes of the blocks it covers."""
        return tuple((image.start, image.end, image.key) for image in self.images)

    @property
    def end(self) -> int:
        """One past the last placeholder position of the last image."""
        return self.images[-1].end

    @property
    def mrope(self) -> bool:
        """Whether its images carry multimodal RoPE positions."""
        return self.images[0].rope_positions is not None

    def rope_shift(self, position: int) -> int:
        """What a text token's rotary position differs from its prompt position by (multimodal RoPE), at prompt
        `position` (or past the prompt: a decode's, the last image's shift, HF's rope_delta)."""
        shift = 0
        for image in self.images:
            if image.end > position:
                break
            shift = image.rope_shift
        return shift
