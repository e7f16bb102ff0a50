"""A tiny random Gemma3ForConditionalGeneration (a 2-layer SigLIP tower, Gemma 3's projector, the tiny gemma3_text
language model with sliding and global layers) saved as transformers saves it, with a Gemma3Processor of tiny
images beside it; HF's greedy reference on it, token_type_ids and all (its bidirectional image mask)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Sequence

from tests.engine.factories import make_tiny_tokenizer, tiny_config_dict
from tests.engine.vision_factories import chat_text as vision_chat_text
from tests.engine.vision_factories import hf_greedy, hf_vision_model  # noqa: F401 (hf_greedy: re-exported)

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
BOI_ID, IMAGE_ID, EOI_ID = 512, 513, 514  # after the tiny tokenizer's 512
VOCAB_SIZE = 576
IMAGE_SIZE, PATCH_SIZE = 32, 4  # 8 x 8 patches, pooled 2 x 2 into 16 image tokens
TOKENS_PER_IMAGE = 16

# ChatML, content as text or as parts: an image part writes Gemma 3's image placeholder, as its own template does
GEMMA3_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_gemma3_tokenizer() -> Any:
    """The tiny tokenizer with Gemma 3's image tokens (512-514), named as Gemma3Processor reads them."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = make_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [BOI, IMAGE, EOI]})
    with tempfile.TemporaryDirectory() as folder:  # (the named tokens are set when a tokenizer is loaded)
        tokenizer.save_pretrained(folder)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            folder, extra_special_tokens={"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI}
        )
    assert (tokenizer.boi_token_id, tokenizer.image_token_id, tokenizer.eoi_token_id) == (BOI_ID, IMAGE_ID, EOI_ID)
    tokenizer.chat_template = GEMMA3_TEMPLATE
    return tokenizer


def make_tiny_gemma3_dir(path: Path, *, seed: int = 0, **text_overrides: Any) -> Path:
    """A Gemma3ForConditionalGeneration of the tiny gemma3_text model (`text_overrides` on its config: a sliding
    window of 8, shorter than an image) and a 2-layer SigLIP tower of IMAGE_SIZE images, with its processor
    (Gemma3ImageProcessor, Gemma3Processor), tokenizer and generation config."""
    import torch
    from transformers import (
        AutoConfig,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        GenerationConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = make_gemma3_tokenizer()
    text = tiny_config_dict("gemma3", vocab_size=VOCAB_SIZE, **text_overrides)
    text.pop("architectures")
    vision_config = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    config = Gemma3Config(
        text_config=AutoConfig.for_model(**text),
        vision_config=vision_config,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=BOI_ID,
        image_token_index=IMAGE_ID,
        eoi_token_index=EOI_ID,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # (the projector starts at zero and SigLIP near it: images would not move the logits)
        for name, parameter in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                parameter.normal_(0.0, 0.2 if parameter.dim() > 1 else 0.05)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=TOKENS_PER_IMAGE,
        chat_template=GEMMA3_TEMPLATE,
    ).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)
    return path


def chat_text(parts: Sequence[Any]) -> str:
    """One user turn's prompt text as GEMMA3_TEMPLATE renders it (strings are text parts, anything else an image),
    with the generation prompt."""
    return vision_chat_text(parts, BOI)


def hf_prompt_logprobs(model_dir: Path, text: str, images: Sequence[Any]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1, over HF's forward of the whole prompt with its images."""
    import torch

    model, processor = hf_vision_model(str(model_dir))
    inputs = processor(text=[text], images=list(images) or None, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    ids = inputs["input_ids"][0]
    return torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0].tolist()
