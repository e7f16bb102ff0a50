"""A model's RoPE settings as its HF config states them, in the two spellings transformers has used: one
reading for the model families, the served context's derivation and the GGUF conversion."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def rope_settings(hf_config: "PretrainedConfig", layer_type: str = "full_attention") -> tuple[float, Optional[dict]]:
    """(rope_theta, scaling) from transformers 5 `rope_parameters` or older `rope_theta`/`rope_scaling`.

    `scaling` is None for plain RoPE; otherwise a dict with a normalised `rope_type` key
    (e.g. "llama3", "linear", "yarn") and that type's parameters, without `rope_theta`. Configs with
    parameters per layer type (Gemma 3: "full_attention", "sliding_attention") give `layer_type`'s.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get(layer_type) or next(iter(params.values()))  # per layer type
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], dict(params)
    else:
        theta = getattr(hf_config, "rope_theta", None)
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    if theta is None:
        theta = 10000.0
    scaling.pop("rope_theta", None)
    rope_type = scaling.pop("type", None)
    scaling.setdefault("rope_type", rope_type or "default")
    if scaling["rope_type"] == "default":
        return float(theta), None
    return float(theta), scaling


def mrope_section(hf_config: "PretrainedConfig") -> Optional[tuple[int, ...]]:
    """Multimodal RoPE's sections (Qwen2-VL, Qwen2.5-VL: `mrope_section`, e.g. [16, 24, 24]): how many of each
    head's rotary pairs rotate by the temporal, height and width position in turn; None for 1-D RoPE."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(hf_config, name, None)
        if isinstance(params, dict) and params.get("mrope_section"):
            return tuple(int(size) for size in params["mrope_section"])
    return None
