"""The context a RoPE scaling extends a config's to: what `max_model_len` defaults to and may reach.

A linear or YaRN scaling is a recipe for serving past the positions the model was trained on, and checkpoints
that ship one (Vicuna-16k's linear factor 4 over max_position_embeddings 4096; Qwen2.5/Qwen3's documented YaRN
recipe, factor 4 over original_max_position_embeddings 32768) keep max_position_embeddings at the trained context.
vLLM derives the served context from the scaling, as HF transformers computes every position's rotation on the fly:

    linear   max_position_embeddings          x factor
    yarn     original_max_position_embeddings x factor

LongRoPE and llama3 configs already state the extended context in max_position_embeddings; Gemma 3's scaled
global layers too (vLLM's exceptions, the same here). No torch: the model section reads it before any model loads.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

SCALED_CONTEXT_TYPES = ("linear", "yarn")
"""The served RoPE scaling types whose config states the context before scaling."""


class ScaledContext(NamedTuple):
    length: int
    source: str  # how it was derived, for messages: "original_max_position_embeddings 32 x the yarn RoPE factor 4"


def scaled_context(model_type: str, max_position_embeddings: int, scaling: Optional[dict]) -> Optional[ScaledContext]:
    """The context `scaling` (rope_settings' normalised dict) extends the config's to, as vLLM derives it; None
    where it does not (no scaling, a type that states its context, no factor, Gemma 3)."""
    if scaling is None or "gemma3" in model_type:
        return None
    rope_type, factor = scaling.get("rope_type"), scaling.get("factor")
    if rope_type not in SCALED_CONTEXT_TYPES or factor is None:
        return None
    key, base = "max_position_embeddings", max_position_embeddings
    if rope_type == "yarn" and scaling.get("original_max_position_embeddings") is not None:
        key, base = "original_max_position_embeddings", int(scaling["original_max_position_embeddings"])
    return ScaledContext(int(base * float(factor)), f"{key} {base} x the {rope_type} RoPE factor {float(factor):g}")
