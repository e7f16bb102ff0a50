"""A vision-language model's HF processor (AutoProcessor, from the checkpoint): a rendered prompt and its images
to token ids, each image's placeholder expanded as the model expects, and each image's encoder inputs."""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from engine.errors import InvalidParameterError
from engine.multimodal.image_layout import ImageLayout
from engine.multimodal.image_only_processor import ImageOnlyProcessor
from engine.multimodal.inputs import ImageInput, MultiModalInputs
from engine.multimodal.mrope_positions import MRopePositions

logger = logging.getLogger(__name__)

# The processor's outputs that belong to the text, not to an image.
TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


class MultiModalProcessor:
    """The model's HF processor, how it lays a prompt's images out in its outputs (the family's), how many images a
    prompt may hold (vLLM's --limit-mm-per-prompt); `bidirectional`: the model's image tokens attend to each other
    both ways (MultiModalInputs)."""

    def __init__(
        self,
        hf_processor: Any,
        image_token_id: int,
        max_images: int,
        layout: ImageLayout = ImageLayout(),
        bidirectional: bool = False,
        rope: Optional[MRopePositions] = None,
    ):
        self.hf = hf_processor
        self.image_token_id = image_token_id
        self.max_images = max_images
        self.layout = layout
        self.bidirectional = bidirectional
        self.rope = rope  # a multimodal-RoPE model's rule placing its images' rotary positions (None: 1-D RoPE)
        token = getattr(hf_processor, "image_token", None)
        if not isinstance(token, str):
            token = hf_processor.tokenizer.convert_ids_to_tokens(image_token_id)
        self.image_placeholder: str = token  # what a prompt writes where an image goes
        # (one call at a time: a fast tokenizer's padding and truncation settings are state its calls share)
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        path: Union[str, Path],
        image_token_id: int,
        max_images: int,
        trust_remote_code: bool = False,
        layout: ImageLayout = ImageLayout(),
        bidirectional: bool = False,
        rope: Optional[MRopePositions] = None,
    ) -> "MultiModalProcessor":
        from transformers import AutoProcessor

        try:
            hf = AutoProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except ImportError as error:  # (a part needs a package not installed, torchvision for most: a video processor)
            hf = _image_only(path, image_token_id, trust_remote_code, error)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"cannot load the model's image processor from {str(path)!r}: {error}") from error
        if not hasattr(hf, "image_processor"):
            raise ValueError(f"the processor in {str(path)!r} ({type(hf).__name__}) has no image processor")
        return cls(hf, image_token_id, max_images, layout, bidirectional, rope)

    def check_count(self, count: int, param: str) -> None:
        if count > self.max_images:
            raise InvalidParameterError(
                param, f"holds {count} images; at most {self.max_images} per prompt (--limit-mm-per-prompt)"
            )

    def process(
        self, text: str, images: Sequence[Any], *, add_special_tokens: bool = False, param: str = "messages"
    ) -> tuple[list[int], Optional[MultiModalInputs]]:
        """`text`'s token ids with each of its image placeholders (one per image, in order) expanded, and the
        images' encoder inputs (None without images). InvalidParameterError naming `param` when the prompt's
        placeholders and its images do not pair up."""
        self.check_count(len(images), param)
        written = text.count(self.image_placeholder)
        if written != len(images):
            raise InvalidParameterError(
                param,
                f"has {len(images)} image(s) but its prompt writes {written} placeholder(s) {self.image_placeholder!r}",
            )
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt", "add_special_tokens": add_special_tokens}
        if images:
            kwargs["images"] = list(images)
        try:
            with self._lock:
                out = self.hf(**kwargs)
        except (ValueError, TypeError, IndexError, RuntimeError) as error:
            raise InvalidParameterError(param, f"cannot be processed with its images: {error}") from None
        token_ids = [int(t) for t in out["input_ids"][0]]
        if not images:
            return token_ids, None
        return token_ids, self._inputs(out, token_ids, [image.size for image in images], param)

    def _inputs(self, out: Any, token_ids: list[int], sizes: list[tuple[int, int]], param: str) -> MultiModalInputs:
        """Each image's rows of the processor's outputs and the placeholder positions its embeddings fill: the
        images' placeholders in prompt order, as many per image as the processor says it expands it to (as the
        model scatters its images' embeddings over them)."""
        num_tokens, num_rows = self._counts(out, sizes)
        positions = [i for i, token in enumerate(token_ids) if token == self.image_token_id]
        if len(positions) != sum(num_tokens):
            raise InvalidParameterError(
                param,
                f"expands to {len(positions)} image tokens where its {len(sizes)} image(s) take {sum(num_tokens)} "
                "(the prompt's own text holds the image token?)",
            )
        data = {key: value for key, value in out.items() if key not in TEXT_KEYS and isinstance(value, torch.Tensor)}
        images = []
        first_token = first_row = 0
        dim, trim = self.layout.rows_dim, self.layout.trim
        for index, (tokens, rows) in enumerate(zip(num_tokens, num_rows)):
            own = {
                key: _rows(key, value, index, (first_row, rows, sum(num_rows)), len(sizes), dim)
                for key, value in data.items()
            }
            if trim is not None:
                own = trim(own, self.hf)
            own_positions = tuple(positions[first_token : first_token + tokens])
            if self.bidirectional and own_positions and own_positions[-1] - own_positions[0] + 1 != len(own_positions):
                # (a span the model attends both ways is one run of tokens, as the model's mask makes it)
                raise InvalidParameterError(
                    param, "places an image's tokens apart (its own text holds the image token?)"
                )
            images.append(ImageInput(own, own_positions, _digest(own)))
            first_token += tokens
            first_row += rows
        placed = tuple(images) if self.rope is None else self.rope.place(tuple(images), param)
        return MultiModalInputs(placed, self.bidirectional)

    def _counts(self, out: Any, sizes: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """Each image's placeholder tokens and its rows of the outputs with a row per patch (or tile): a grid
        processor's (Qwen2-VL's) read from the grids it returned, one token per merge_size² patches; others' from
        the processor's own count for the images' sizes."""
        grid, merge = out.get("image_grid_thw"), getattr(self.hf.image_processor, "merge_size", None)
        if isinstance(grid, torch.Tensor) and isinstance(merge, int):
            rows = [int(n) for n in grid.prod(-1)]
            return [n // merge**2 for n in rows], rows
        counts = self.hf._get_num_multimodal_tokens(image_sizes=[(height, width) for width, height in sizes])
        return list(counts.num_image_tokens), list(getattr(counts, "num_image_patches", None) or [1] * len(sizes))


def _image_only(path: Union[str, Path], image_token_id: int, trust_remote_code: bool, error: ImportError) -> Any:
    """The checkpoint's tokenizer and image processor composed (ImageOnlyProcessor) where its whole processor
    needs a library not installed for a part that images do not use; ValueError naming the library otherwise."""
    from transformers import AutoImageProcessor, AutoTokenizer

    try:
        image_processor = AutoImageProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (ImportError, OSError, ValueError, KeyError, TypeError):
        image_processor = None
    if image_processor is None or not ImageOnlyProcessor.takes(image_processor):
        raise ValueError(f"cannot load the model's image processor from {str(path)!r}: {error}") from error
    token = getattr(tokenizer, "image_token", None)
    if not isinstance(token, str):
        token = tokenizer.convert_ids_to_tokens(image_token_id)
    logger.info(
        "the checkpoint's processor cannot load (%s); its %s and tokenizer serve images",
        str(error).strip().splitlines()[0],
        type(image_processor).__name__,
    )
    return ImageOnlyProcessor(tokenizer, image_processor, token)


def _rows(
    key: str, value: torch.Tensor, index: int, tiles: tuple[int, int, int], num_images: int, dim: int
) -> torch.Tensor:
    """Image `index`'s part of a processor output, along dimension `dim`: its tiles' rows of a tensor with a row per
    tile (patch) of every image (`tiles`: its first row, its count, every image's), else its one row of a tensor with
    a row per image."""
    first_row, rows, total_rows = tiles
    total = value.shape[dim] if value.dim() > dim else -1
    if total == total_rows:
        return value.narrow(dim, first_row, rows).contiguous()
    if total == num_images:
        return value.narrow(dim, index, 1).contiguous()
    raise ValueError(f"the processor's {key!r} ({list(value.shape)}) cannot be split by image")


def _digest(data: dict[str, torch.Tensor]) -> bytes:
    """A digest of what the encoder reads of one image: its tensors' names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for key in sorted(data):
        tensor = data[key].contiguous()
        digest.update(f"{key}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.digest()
