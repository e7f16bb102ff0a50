"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints (a 2-block vision transformer and merger, the tiny Qwen2 language
model with multimodal RoPE) saved as transformers saves them, beside an image processor of tiny min/max pixels and
the tiny tokenizer with Qwen's vision tokens and a chat template writing them; HF's greedy reference on the same
checkpoint.

The reference's inputs are made here as Qwen2-VL's processor makes them (the image processor's grids, each
`<|image_pad|>` repeated once per merged patch, `mm_token_type_ids` marking the image tokens): transformers builds
that processor only with torchvision, for its video part, and torchvision is not installed here."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from tests.engine.factories import make_tiny_tokenizer, tiny_config_dict
from tests.engine.vision_factories import hf_generate

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
IMAGE_TOKEN_ID = 514  # the tokenizer's 512, then vision_start (512), vision_end (513), image_pad (514), video_pad
VOCAB_SIZE = 576
MERGE = 2  # spatial_merge_size: 2 x 2 patches of 14 pixels to a token
# 6 to 12 tokens an image: every test image has a grid of its own shape (rows and columns differ)
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 6, 28 * 28 * 12
MROPE_SECTION = [2, 3, 3]  # of the tiny model's 8 rotary pairs (head_dim 16)

# ChatML, content as text or as parts: an image part writes Qwen's vision tokens, as its templates do
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def make_tiny_qwen_vl_dir(path: Path, model_type: str = "qwen2_vl", *, seed: int = 0, tied: bool = False) -> Path:
    """A tiny random Qwen2-VL (`qwen2_vl`) or Qwen2.5-VL (`qwen2_5_vl`: window attention, window_size 56 pixels,
    the second block full) with its image processor (Pillow's build), tokenizer and generation config."""
    import torch
    import transformers
    from transformers import GenerationConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = make_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]})
    assert tokenizer.convert_tokens_to_ids(IMAGE_PAD) == IMAGE_TOKEN_ID
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    text = tiny_config_dict("qwen2", vocab_size=VOCAB_SIZE, tie_word_embeddings=tied)
    for key in ("architectures", "model_type", "rope_theta"):
        text.pop(key, None)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION}
    vision: dict[str, Any] = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=MERGE, temporal_patch_size=2)
    if model_type == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64)
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        vision.update(
            hidden_size=32, out_hidden_size=64, intermediate_size=64, window_size=56, fullatt_block_indexes=[1]
        )
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=IMAGE_TOKEN_ID + 1,
        vision_start_token_id=IMAGE_TOKEN_ID - 2,
        vision_end_token_id=IMAGE_TOKEN_ID - 1,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # (the default init is near zero: images would barely move the logits)
        for name, parameter in model.named_parameters():
            if "visual" in name:
                parameter.normal_(0.0, 0.2 if parameter.dim() > 1 else 0.05)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(path)
    tokenizer.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)
    return path


def qwen_chat_text(parts: Sequence[Any]) -> str:
    """One user turn's prompt text as QWEN_VL_TEMPLATE renders it (strings are text parts, anything else an
    image), with the generation prompt."""
    image = VISION_START + IMAGE_PAD + VISION_END
    body = "".join(part if isinstance(part, str) else image for part in parts)
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


@lru_cache(maxsize=2)
def hf_reference(model_dir: str) -> tuple[Any, Any, Any]:
    """HF's model of the checkpoint (float32), its image processor and tokenizer."""
    import torch
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    config = AutoConfig.from_pretrained(model_dir)
    classes = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}
    model = classes[config.model_type].from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoImageProcessor.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


def hf_inputs(model_dir: Path, text: str, images: Sequence[Any]) -> dict[str, Any]:
    """The model's inputs for `text` and its images, as Qwen2-VL's processor makes them."""
    _, image_processor, tokenizer = hf_reference(str(model_dir))
    inputs: dict[str, Any] = {}
    if images:
        inputs.update(image_processor(list(images), return_tensors="pt"))
        pieces = text.split(IMAGE_PAD)
        counts = [int(n) // MERGE**2 for n in inputs["image_grid_thw"].prod(-1)]
        text = pieces[0] + "".join(IMAGE_PAD * n + piece for n, piece in zip(counts, pieces[1:]))
    encoded = tokenizer([text], add_special_tokens=False, return_tensors="pt")
    inputs["input_ids"] = encoded["input_ids"]
    inputs["attention_mask"] = encoded["attention_mask"]
    inputs["mm_token_type_ids"] = (encoded["input_ids"] == IMAGE_TOKEN_ID).int()
    return inputs


def hf_greedy(model_dir: Path, text: str, images: Sequence[Any], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens after `text` with its images (float32), and each token's logprob."""
    return hf_generate(hf_reference(str(model_dir))[0], hf_inputs(model_dir, text, images), max_new_tokens)
