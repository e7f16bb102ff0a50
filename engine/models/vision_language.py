"""Vision-language models: a language model of a family served here, given image embeddings in place of its
image placeholder tokens. The language model is the house's own (the family of the checkpoint's `text_config`);
the vision encoder and projector are transformers' own modules for the architecture, built without the language
model and loaded with the checkpoint's vision weights only, and run through the model's `get_image_features` (one
image at a time: its embeddings, one per placeholder position, as HF's model scatters them).

What differs between the families is data here: transformers' model class, its language model's attribute, the
modules (and parameters) that turn pixels into embeddings, and how the processor lays images out (image_layout.py).
A family is served only where HF's model does nothing but that: causal attention over the image tokens as over the
text (Gemma 3 and PaliGemma attend bidirectionally within an image; they are not listed)."""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from engine.multimodal.image_layout import ImageLayout, crop_to_image_size, drop_padding_tiles
from engine.multimodal.inputs import ImageInput
from engine.multimodal.mrope_positions import MRopePositions


@dataclass(frozen=True, slots=True)
class VisionLanguageFamily:
    architecture: str  # the HF `architectures` entry
    model_class: str  # transformers' inner model (vision encoder, projector, language model): module.Class
    text_attribute: str  # that model's language model attribute (dropped)
    # its attributes that turn pixels into embeddings, loaded from the checkpoint: modules, or parameters (LLaVA-NeXT's
    # image_newline, the embedding that closes each row of an image's tiles)
    vision_modules: tuple[str, ...]
    features: tuple[str, ...]  # what of it is implemented, in words (the docs table's last column)
    layout: ImageLayout = ImageLayout()  # how its processor lays a prompt's images out
    # Whether an image's tokens attend to each other both ways during the prompt (HF's token_type_ids mask), the
    # rest causally: each image is then computed in one step (MultiModalInputs.bidirectional)
    bidirectional_images: bool = False
    # Whether its language model rotates by multimodal RoPE (Qwen2-VL): images placed on three position axes
    # (engine/multimodal/mrope_positions.py), their rows rotated by section (engine/layers/mrope.py)
    mrope: bool = False
    # Whether its images are served: False for a checkpoint whose language model alone is (TEXT_ONLY_FAMILIES: no
    # vision encoder is built, its tensors are skipped, a request's images are refused as a text model's)
    images: bool = True


_LANGUAGE_MODEL = "the language model as its family (Llama, Mistral, Qwen2, ...)"
_ANYRES = (
    "anyres tiling (image_grid_pinpoints: the base image and its grid's tiles, unpadded, image_newline closing each "
    "row), image_sizes"
)

VISION_LANGUAGE_FAMILIES = (
    VisionLanguageFamily(
        "LlavaForConditionalGeneration",
        "transformers.models.llava.modeling_llava.LlavaModel",
        "language_model",
        ("vision_tower", "multi_modal_projector"),
        (
            "images: a CLIP / SigLIP vision tower (vision_feature_layer, vision_feature_select_strategy) and the "
            "two-layer projector, transformers' modules",
            _LANGUAGE_MODEL,
        ),
    ),
    VisionLanguageFamily(
        "Mistral3ForConditionalGeneration",
        "transformers.models.mistral3.modeling_mistral3.Mistral3Model",
        "language_model",
        ("vision_tower", "multi_modal_projector"),
        (
            "Mistral Small 3.1 / 3.2: the Pixtral vision encoder at each image's own size, the patch merger "
            "(spatial_merge_size) and projector; an image's [IMG] positions filled row by row ([IMG_BREAK] and "
            "[IMG_END] stay text tokens); its processor needs torchvision",
            "the language model as its family (Mistral)",
        ),
        ImageLayout(trim=crop_to_image_size),
    ),
    VisionLanguageFamily(
        "LlavaNextForConditionalGeneration",
        "transformers.models.llava_next.modeling_llava_next.LlavaNextModel",
        "language_model",
        ("vision_tower", "multi_modal_projector", "image_newline"),
        ("images: LLaVA-NeXT's " + _ANYRES, _LANGUAGE_MODEL),
        ImageLayout(trim=drop_padding_tiles),
    ),
    VisionLanguageFamily(
        "LlavaOnevisionForConditionalGeneration",
        "transformers.models.llava_onevision.modeling_llava_onevision.LlavaOnevisionModel",
        "language_model",
        ("vision_tower", "multi_modal_projector", "image_newline"),
        (
            "images: a SigLIP tower, " + _ANYRES + ", vision_aspect_ratio (anyres_max_N: large grids "
            "scaled down); no video; its processor needs torchvision",
            "the language model as its family (Qwen2)",
        ),
        ImageLayout(trim=drop_padding_tiles),
    ),
    VisionLanguageFamily(
        "InternVLForConditionalGeneration",
        "transformers.models.internvl.modeling_internvl.InternVLModel",
        "language_model",
        ("vision_tower", "multi_modal_projector"),
        (
            "InternVL 3 in transformers' format: InternViT, tiles (crop_to_patches) and a thumbnail, pixel shuffle "
            "(downsample_ratio) and the projector; no video; its processor needs torchvision",
            "the language model as its family (Qwen2, Qwen3, ...)",
        ),
    ),
    VisionLanguageFamily(
        "Idefics3ForConditionalGeneration",
        "transformers.models.idefics3.modeling_idefics3.Idefics3Model",
        "text_model",
        ("vision_model", "connector"),
        (
            "images: the SigLIP encoder on an image's tiles (do_image_splitting) and the global image, the pixel "
            "shuffle connector (scale_factor), pixel_attention_mask",
            "the language model as its family (Llama)",
        ),
        ImageLayout(rows_dim=1),
    ),
    VisionLanguageFamily(
        "SmolVLMForConditionalGeneration",
        "transformers.models.smolvlm.modeling_smolvlm.SmolVLMModel",
        "text_model",
        ("vision_model", "connector"),
        (
            "SmolVLM / SmolVLM2 images as Idefics3's (tiles and the global image, pixel shuffle connector); no "
            "video; its processor needs torchvision and num2words",
            "the language model as its family (Llama)",
        ),
        ImageLayout(rows_dim=1),
    ),
    VisionLanguageFamily(
        "Gemma3ForConditionalGeneration",
        "transformers.models.gemma3.modeling_gemma3.Gemma3Model",
        "language_model",
        ("vision_tower", "multi_modal_projector"),
        (
            "images: the SigLIP vision tower and the projector (average pooling to mm_tokens_per_image, soft-emb "
            "norm), transformers' modules; no pan-and-scan crops",
            "the language model as Gemma 3's (gemma3_text: sliding and global layers); text embeddings scaled by "
            "sqrt(hidden), the images' not",
            "an image's tokens attend to each other both ways during the prompt (sliding layers too, within "
            "their window), each image computed in one step",
        ),
        bidirectional_images=True,
    ),
    VisionLanguageFamily(
        "Qwen2VLForConditionalGeneration",
        "transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VLModel",
        "language_model",
        ("visual",),
        (
            "images at their own resolution (min_pixels / max_pixels), 2x2 patches merged to a token, transformers' "
            "vision transformer and merger",
            "the language model as Qwen2 with multimodal RoPE (mrope_section): text and decoding at 1-D positions "
            "shifted past each image (fused CPU decode step), image rows rotated by section",
            "no video",
        ),
        mrope=True,
    ),
    VisionLanguageFamily(
        "Qwen2_5_VLForConditionalGeneration",
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLModel",
        "language_model",
        ("visual",),
        (
            "as Qwen2-VL: the vision transformer with window attention (fullatt_block_indexes), RMSNorm and SwiGLU",
            "the language model as Qwen2 with multimodal RoPE",
            "no video",
        ),
        mrope=True,
    ),
    VisionLanguageFamily(
        "AyaVisionForConditionalGeneration",
        "transformers.models.aya_vision.modeling_aya_vision.AyaVisionModel",
        "language_model",
        ("vision_tower", "multi_modal_projector"),
        (
            "Aya Vision: the SigLIP tower on an image's tiles (crop_to_patches) and the global image, pixel shuffle "
            "(downsample_factor) and the SwiGLU projector, transformers' modules; its image processor (GotOcr2's) "
            "runs on PIL without torchvision",
            "the language model as its family (Cohere 2: logit_scale, RoPE-less global layers)",
        ),
    ),
)


TEXT_ONLY_FAMILIES = (
    VisionLanguageFamily(
        "Llama4ForConditionalGeneration",
        "",  # (no transformers model is built: its images are not served)
        "language_model",
        ("vision_model", "multi_modal_projector"),
        ("Llama 4's language model (language_model.*) as Llama4ForCausalLM; its images refused",),
        images=False,
    ),
    # Qwen3.5's checkpoints are multimodal: their language model served as Qwen3_5(Moe)ForCausalLM; the tensors of
    # the vision encoder (visual.*) and of the multi-token-prediction layer (mtp.*, which transformers skips too)
    # are not read
    VisionLanguageFamily(
        "Qwen3_5ForConditionalGeneration",
        "",
        "language_model",
        ("visual", "mtp"),
        ("Qwen3.5's language model (language_model.*) as Qwen3_5ForCausalLM; its images refused",),
        images=False,
    ),
    VisionLanguageFamily(
        "Qwen3_5MoeForConditionalGeneration",
        "",
        "language_model",
        ("visual", "mtp"),
        ("Qwen3.5-MoE's language model (language_model.*) as Qwen3_5MoeForCausalLM; its images refused",),
        images=False,
    ),
)
"""Multimodal checkpoints whose language model is served, as a text model, without their images."""


def vision_family_of(config: Any) -> Optional[VisionLanguageFamily]:
    """The vision-language family of a checkpoint's (whole) config (one served text only too); None for a text
    model."""
    architectures = list(getattr(config, "architectures", None) or [])
    families = VISION_LANGUAGE_FAMILIES + TEXT_ONLY_FAMILIES
    return next((family for family in families if family.architecture in architectures), None)


def image_token_id(config: Any) -> int:
    """The id of the token each image's placeholder positions hold."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{config.architectures}: the config names no image token (image_token_id)")


# Checkpoint names of the language model's tensors, as transformers writes them (older and newer layouts), and the
# names the house's models read.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("language_model.", "model."),
    ("model.text_model.", "model."),  # (Idefics3, SmolVLM)
    ("lm_head.", "lm_head."),
    ("model.", "model."),  # (Qwen2-VL's layout: the language model's tensors as a text model's, beside visual.*)
)


def text_weight_name(name: str, family: VisionLanguageFamily) -> Optional[str]:
    """A checkpoint tensor's name as the language model reads it; None for the vision encoder's and projector's."""
    if _vision_module(name, family) is not None:
        return None
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    raise ValueError(f"checkpoint tensor {name!r} belongs to neither the language model nor the vision encoder")


def text_weights(weights: Iterable[tuple[str, Any]], family: VisionLanguageFamily) -> Iterator[tuple[str, Any]]:
    """The language model's tensors of a checkpoint's, by the names the house's models read."""
    for name, tensor in weights:
        text_name = text_weight_name(name, family)
        if text_name is not None:
            yield text_name, tensor


def _vision_module(name: str, family: VisionLanguageFamily) -> Optional[tuple[str, str]]:
    """(module, the tensor's name inside it: "" for a parameter of the model itself) for a vision encoder's or
    projector's tensor, else None."""
    for module in family.vision_modules:
        for prefix in (f"model.{module}", module):
            if name == prefix:
                return module, ""
            if name.startswith(prefix + "."):
                return module, name[len(prefix) + 1 :]
    return None


def _load_module(
    hf: torch.nn.Module, module: str, state: dict[str, torch.Tensor], family: VisionLanguageFamily
) -> None:
    """The checkpoint's tensors of one of the model's vision modules (or its one tensor, for a parameter) loaded into
    it; ValueError for a tensor missing or left over."""
    target = getattr(hf, module)
    if isinstance(target, torch.nn.Parameter):
        if set(state) != {""} or state[""].shape != target.shape:
            raise ValueError(
                f"{family.architecture}: the checkpoint's {module} ({[list(t.shape) for t in state.values()]}) does "
                f"not fit transformers' parameter ({list(target.shape)})"
            )
        with torch.no_grad():
            target.copy_(state[""])
        return
    missing, unexpected = target.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{family.architecture}: the checkpoint's {module} weights do not fit transformers' module "
            f"(missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})"
        )


class VisionEncoder:
    """Images to embeddings in the language model's dtype: transformers' model of the architecture without its
    language model."""

    def __init__(
        self,
        hf_model: torch.nn.Module,
        family: VisionLanguageFamily,
        dtype: torch.dtype,
        token_id: int,
        rope: Optional[MRopePositions] = None,
    ):
        self.hf: Any = hf_model  # (its get_image_features, typed by transformers per architecture)
        self.family = family
        self.image_token_id = token_id  # what the prompt's placeholder positions hold
        self.rope = rope  # where a multimodal-RoPE model places its images' rotary positions (the processor's rule)
        self.dtype = dtype
        self.device = next(hf_model.parameters()).device
        self.num_parameters = sum(p.numel() for p in hf_model.parameters())

    @classmethod
    def load(
        cls,
        path: Union[str, Path],
        config: Any,
        family: VisionLanguageFamily,
        dtype: torch.dtype,
        device: torch.device,
    ) -> "VisionEncoder":
        """Built from the whole config with a language model of no layers (then dropped), its vision modules' weights
        read from the checkpoint in `path`; ValueError for a tensor missing or left over."""
        from transformers.initialization import no_init_weights

        from engine.loading.loader import iter_weights
        from engine.quantization.fp8_checkpoint import fp8_checkpoint_weights

        module_path, class_name = family.model_class.rsplit(".", 1)
        model_class = getattr(importlib.import_module(module_path), class_name)
        shell = copy.deepcopy(config)
        text = shell.get_text_config()
        # (the language model is dropped: built as small as it goes, with no padding row its one-row vocabulary lacks)
        text.num_hidden_layers, text.vocab_size, text.pad_token_id = 0, 1, None
        with no_init_weights():
            hf = model_class(shell)
        setattr(hf, family.text_attribute, None)
        state: dict[str, dict[str, torch.Tensor]] = {module: {} for module in family.vision_modules}
        stored = iter_weights(path, keep=lambda n: _vision_module(n, family) is not None)
        for name, tensor in fp8_checkpoint_weights(stored, config, dtype, device):  # (FP8 vision matrices too)
            found = _vision_module(name, family)
            assert found is not None
            state[found[0]][found[1]] = tensor
        for module in family.vision_modules:
            _load_module(hf, module, state[module], family)
        hf.to(device=device, dtype=dtype).eval()
        rope = MRopePositions(config.vision_config.spatial_merge_size) if family.mrope else None
        return cls(hf, family, dtype, image_token_id(config), rope)

    @torch.inference_mode()
    def encode(self, image: ImageInput) -> torch.Tensor:
        """[image.num_embeds, hidden]: the image's embeddings in the model's dtype, one per placeholder position."""
        data = {
            key: value.to(self.device, self.dtype if value.is_floating_point() else value.dtype)
            for key, value in image.data.items()
        }
        out = self.hf.get_image_features(**data)
        features = getattr(out, "pooler_output", out)
        if isinstance(features, (list, tuple)):
            features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        features = features.reshape(-1, features.shape[-1]).to(self.dtype)
        if features.shape[0] != image.num_embeds:
            raise ValueError(
                f"the vision encoder gave {features.shape[0]} embeddings for an image of {image.num_embeds} "
                "placeholder tokens"
            )
        return features
