"""Tiny random vision-language checkpoints (LLaVA: a CLIP vision tower, the projector, a tiny language model of a
family served here) saved as transformers saves them, with a processor whose chat template writes `<image>` for
an image part; random images; HF's greedy reference on the same checkpoint."""

from __future__ import annotations

import base64
import io
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from tests.engine.factories import make_tiny_tokenizer, tiny_config_dict

IMAGE_TOKEN = "<image>"
VOCAB_SIZE = 576  # the tokenizer's 512, its image token (512), and rows to spare

# ChatML, content as text or as parts: an image part writes the placeholder, as HF's LLaVA templates do
VISION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tiny_llava_dir(
    path: Path,
    text_arch: str = "llama",
    *,
    seed: int = 0,
    image_size: int = 30,
    patch_size: int = 6,
    select_strategy: str = "default",
    feature_layer: int = -2,
) -> Path:
    """A LlavaForConditionalGeneration of a tiny `text_arch` language model and a 2-layer CLIP vision tower:
    (image_size / patch_size)^2 image tokens per image (one more with the "full" select strategy), with its
    processor (CLIPImageProcessor, LlavaProcessor), tokenizer and generation config."""
    import torch
    from transformers import (
        AutoConfig,
        CLIPImageProcessor,
        CLIPVisionConfig,
        GenerationConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = make_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VISION_TEMPLATE
    text = tiny_config_dict(text_arch, vocab_size=VOCAB_SIZE)
    text.pop("architectures")
    text_config = AutoConfig.for_model(**text)
    vision_config = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=select_strategy,
        projector_hidden_act="gelu",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # (CLIP's default init is near zero: images would barely move the logits)
        for name, parameter in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                parameter.normal_(0.0, 0.2 if parameter.dim() > 1 else 0.05)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=select_strategy,
        chat_template=VISION_TEMPLATE,
        num_additional_image_tokens=1,
    ).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)
    return path


def random_image(seed: int, width: int = 50, height: int = 40) -> Any:
    """A PIL RGB image of random pixels."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def data_url(image: Any, image_format: str = "PNG") -> str:
    """`image` as a data: URL, as a client sends it."""
    buffer = io.BytesIO()
    image.save(buffer, image_format)
    return f"data:image/{image_format.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def chat_text(parts: Sequence[Any], placeholder: str = IMAGE_TOKEN) -> str:
    """One user turn's ChatML prompt as VISION_TEMPLATE renders it (strings are text parts, anything else an image,
    written as `placeholder`), with the generation prompt."""
    body = "".join(part if isinstance(part, str) else placeholder for part in parts)
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


@lru_cache(maxsize=4)
def hf_vision_model(model_dir: str) -> tuple[Any, Any]:
    """transformers' model of a vision-language checkpoint (float32, eval) and its processor."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def hf_greedy(model_dir: Path, text: str, images: Sequence[Any], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens after `text` with its images (float32), and each token's logprob."""
    model, processor = hf_vision_model(str(model_dir))
    inputs = processor(text=[text], images=list(images) or None, return_tensors="pt", add_special_tokens=False)
    return hf_generate(model, inputs, max_new_tokens)


def hf_generate(model: Any, inputs: Any, max_new_tokens: int) -> tuple[list[int], list[float]]:
    """`model.generate`'s greedy tokens after `inputs` (no end of sequence), and each token's logprob."""
    import torch

    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=None,
        )
    prompt_len = inputs["input_ids"].shape[1]
    tokens = out.sequences[0, prompt_len:].tolist()
    logprobs = [float(torch.log_softmax(score[0].float(), -1)[t]) for score, t in zip(out.scores, tokens)]
    return tokens, logprobs
