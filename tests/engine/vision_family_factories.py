"""Tiny random checkpoints of the vision-language families beyond LLaVA (Mistral 3, LLaVA-NeXT, LLaVA-OneVision,
InternVL, Idefics3, SmolVLM, Aya Vision), saved as transformers 5 saves them, each with its own processor (tiny image and tile
sizes: a few to a few dozen image tokens per image), and HF's greedy reference on the same checkpoint."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tests.engine.factories import make_tiny_tokenizer, tiny_config_dict
from tests.engine.vision_factories import VOCAB_SIZE, chat_text, hf_greedy  # noqa: F401 (hf_greedy: re-exported)

PINPOINTS = [[30, 60], [60, 30], [60, 60]]  # LLaVA-NeXT's anyres grids, in 30-pixel tiles


@dataclass(frozen=True)
class VisionFamilyCase:
    """A family's tiny checkpoint: how to build it, what a prompt writes for an image, and the packages its
    processor needs beyond transformers (a family whose processor cannot load here is skipped, naming them)."""

    name: str
    build: Callable[[Path], Path]
    placeholder: str
    needs: tuple[str, ...] = ()

    def missing(self) -> list[str]:
        return [package for package in self.needs if importlib.util.find_spec(package) is None]


def _tokenizer(special: Sequence[str], **extra: str) -> Any:
    """The tiny tokenizer with the family's special tokens added (ids from 512 on), and `extra` as named special
    tokens (transformers' extra_special_tokens: an attribute per name, as InternVL's processor reads them)."""
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    if extra:  # (saved in its tokenizer_config.json: a reloaded tokenizer has them too)
        tokenizer._set_model_specific_special_tokens(extra)
    return tokenizer


def _text_config(arch: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    text = tiny_config_dict(arch, vocab_size=VOCAB_SIZE, **overrides)
    text.pop("architectures")
    return AutoConfig.for_model(**text)


def _save(path: Path, model_class: type, config: Any, processor: Any, vision_prefixes: tuple[str, ...]) -> Path:
    """The model with random weights (its vision parts' scaled up: near-zero defaults would barely move the
    logits), its processor and generation config, saved in `path`."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(prefix in name for prefix in vision_prefixes) and "norm" not in name:
                parameter.normal_(0.0, 0.2 if parameter.dim() > 1 else 0.05)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)
    return path


def make_tiny_mistral3_dir(path: Path) -> Path:
    """Mistral 3 (Mistral Small 3.1): a 2-layer Pixtral vision encoder (4-pixel patches), the patch merger (2x2) and
    projector, a tiny Mistral; images resized to at most 32 pixels a side: up to 4x4 [IMG] tokens, each row ended by
    [IMG_BREAK], the last by [IMG_END]."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig
    from transformers.models.pixtral.image_processing_pixtral import PixtralImageProcessor
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    tokenizer = _tokenizer(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    vision = PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16, patch_size=4
    )
    config = Mistral3Config(
        vision_config=vision,
        text_config=_text_config("mistral", sliding_window=None),  # (Mistral Small 3's: the tiny one's 8 hides images)
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    image_processor = PixtralImageProcessor(size={"longest_edge": 32}, patch_size={"height": 4, "width": 4})
    processor = PixtralProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=4, spatial_merge_size=2
    )
    return _save(path, Mistral3ForConditionalGeneration, config, processor, ("vision_tower", "multi_modal_projector"))


def make_tiny_llava_next_dir(path: Path) -> Path:
    """LLaVA-NeXT: a 2-layer CLIP tower on 30-pixel tiles (25 patches), anyres over PINPOINTS (the base image and up
    to 4 tiles, unpadded, a newline embedding closing each row), a tiny Llama."""
    from transformers import (
        CLIPVisionConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    tokenizer = _tokenizer(["<image>"])
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=30,
        patch_size=6,
        projection_dim=32,
    )
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=_text_config("llama"),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=PINPOINTS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30}, image_grid_pinpoints=PINPOINTS
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=6,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return _save(
        path, LlavaNextForConditionalGeneration, config, processor, ("vision_tower", "multi_modal_projector", "newline")
    )


def make_tiny_llava_onevision_dir(path: Path) -> Path:
    """LLaVA-OneVision: a 2-layer SigLIP tower on 30-pixel tiles (25 patches), anyres over PINPOINTS for a prompt's
    only image (the base image alone for each of several), a tiny Qwen2."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        SiglipVisionConfig,
    )

    tokenizer = _tokenizer(["<image>", "<video>"])
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=30, patch_size=6
    )
    config = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=_text_config("qwen2"),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=PINPOINTS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_1",  # (past one tile's area the unpadded grid is scaled down)
        tie_word_embeddings=False,
    )
    image_processor = LlavaOnevisionImageProcessor(size={"height": 30, "width": 30}, image_grid_pinpoints=PINPOINTS)
    processor = LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(size={"height": 30, "width": 30}),
        num_image_tokens=25,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_1",
    )
    return _save(
        path,
        LlavaOnevisionForConditionalGeneration,
        config,
        processor,
        ("vision_tower", "multi_modal_projector", "newline"),
    )


def make_tiny_internvl_dir(path: Path) -> Path:
    """InternVL (InternVL3 in transformers' format): a 2-layer InternViT on 16-pixel tiles (16 patches, pixel-shuffled
    to 4 tokens), up to 4 tiles and a thumbnail per image, each image between <img> and </img>, a tiny Qwen2."""
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
        InternVLVisionConfig,
    )

    tokenizer = _tokenizer(
        ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"],
        start_image_token="<img>",
        end_image_token="</img>",
        context_image_token="<IMG_CONTEXT>",
        video_token="<video>",
    )
    vision = InternVLVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=[16, 16],
        patch_size=[4, 4],
    )
    config = InternVLConfig(
        vision_config=vision,
        text_config=_text_config("qwen2"),
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    image_processor = GotOcr2ImageProcessor(
        size={"height": 16, "width": 16}, crop_to_patches=True, min_patches=1, max_patches=4
    )
    processor = InternVLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(size={"height": 16, "width": 16}),
        image_seq_length=4,
    )
    return _save(path, InternVLForConditionalGeneration, config, processor, ("vision_tower", "multi_modal_projector"))


def _make_idefics_dir(path: Path, smol: bool, tie_word_embeddings: bool = False, text_ties: bool = False) -> Path:
    """Idefics3 / SmolVLM: a 2-layer SigLIP-like encoder on 16-pixel tiles (16 patches, pixel-shuffled 2x2 to 4
    tokens), images resized to at most 32 pixels a side and split into 16-pixel tiles plus the global image, a tiny
    Llama (`tie_word_embeddings`: the whole config's flag; `text_ties`: the language model's)."""
    import transformers as tf

    tokenizer = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"])
    prefix = "SmolVLM" if smol else "Idefics3"
    vision = getattr(tf, f"{prefix}VisionConfig")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4
    )
    config = getattr(tf, f"{prefix}Config")(
        vision_config=vision,
        text_config=_text_config("llama", tie_word_embeddings=text_ties),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        tie_word_embeddings=tie_word_embeddings,
    )
    image_processor = getattr(tf, f"{prefix}ImageProcessor")(
        size={"longest_edge": 32}, max_image_size={"longest_edge": 16}, do_image_splitting=True
    )
    extra = {"video_processor": tf.SmolVLMVideoProcessor()} if smol else {}
    processor = getattr(tf, f"{prefix}Processor")(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, **extra
    )
    model_class = getattr(tf, f"{prefix}ForConditionalGeneration")
    return _save(path, model_class, config, processor, ("vision_model", "connector"))


def make_tiny_idefics3_dir(path: Path, tie_word_embeddings: bool = False, text_ties: bool = False) -> Path:
    return _make_idefics_dir(path, False, tie_word_embeddings, text_ties)


def make_tiny_smolvlm_dir(path: Path) -> Path:
    return _make_idefics_dir(path, smol=True)


def make_tiny_aya_vision_dir(path: Path) -> Path:
    """Aya Vision: a 2-layer SigLIP tower on 16-pixel tiles (16 patches, pixel-shuffled 2x2 to 4 tokens), the SwiGLU
    projector, up to 4 tiles and the global image per image (GotOcr2's tiling), each between <|START_OF_IMG|> and
    <|END_OF_IMG|>, a tiny Cohere 2 (sliding and RoPE-less global layers, logit_scale)."""
    from transformers import (
        AyaVisionConfig,
        AyaVisionForConditionalGeneration,
        AyaVisionProcessor,
        GotOcr2ImageProcessor,
        SiglipVisionConfig,
    )

    tokenizer = _tokenizer(["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"])
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
        vision_use_head=False,  # (Aya Vision's: the tower's last hidden states, no pooling head)
    )
    config = AyaVisionConfig(
        vision_config=vision,
        text_config=_text_config("cohere2"),
        image_token_index=tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"),
        downsample_factor=2,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        tie_word_embeddings=True,
    )
    image_processor = GotOcr2ImageProcessor(
        size={"height": 16, "width": 16}, crop_to_patches=True, min_patches=1, max_patches=4
    )
    processor = AyaVisionProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=4, img_size=16, downsample_factor=2
    )
    return _save(path, AyaVisionForConditionalGeneration, config, processor, ("vision_tower", "multi_modal_projector"))


FAMILY_CASES = {
    case.name: case
    for case in (
        VisionFamilyCase("mistral3", make_tiny_mistral3_dir, "[IMG]", ("torchvision",)),
        VisionFamilyCase("llava_next", make_tiny_llava_next_dir, "<image>"),
        VisionFamilyCase("llava_onevision", make_tiny_llava_onevision_dir, "<image>", ("torchvision",)),
        VisionFamilyCase("internvl", make_tiny_internvl_dir, "<IMG_CONTEXT>", ("torchvision",)),
        VisionFamilyCase("idefics3", make_tiny_idefics3_dir, "<image>"),
        VisionFamilyCase("smolvlm", make_tiny_smolvlm_dir, "<image>", ("torchvision", "num2words")),
        VisionFamilyCase("aya_vision", make_tiny_aya_vision_dir, "<image>"),  # (GotOcr2's PIL image processor)
    )
}


def prompt_text(parts: Sequence[Any], placeholder: str) -> str:
    """One user turn's ChatML prompt, each image written as `placeholder` (vision_factories.chat_text)."""
    return chat_text(parts, placeholder)
