"""The shape and the recipe of a generic pre/post-norm decoder (Gemma 2/3, Phi-3, OLMo 2, Granite), as data.

A Llama layer is `x + attn(norm(x))`, then `x + mlp(norm(x))`. The families here differ from it only in
what `DecoderArch` says: which norms a layer has (`norms`: before and/or after each branch), the MLP's
activation, q/k norms per head or over the whole projection, scalars on the embeddings, the residual
branches and the logits, a final soft-cap, per layer its attention (window, soft-cap, scale) and RoPE, and how
much of each head RoPE rotates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.attention.layer_attention import LayerAttention
from engine.models.llama_arch import LlamaArch

NORM_ROLES = ("attn_pre", "attn_post", "mlp_pre", "mlp_post")
"""Where a layer may have an RMSNorm: on the attention branch's input or output, on the MLP's input or output."""
LLAMA_NORMS = (("attn_pre", "input_layernorm"), ("mlp_pre", "post_attention_layernorm"))
SANDWICH_NORMS = (
    ("attn_pre", "input_layernorm"),
    ("attn_post", "post_attention_layernorm"),
    ("mlp_pre", "pre_feedforward_layernorm"),
    ("mlp_post", "post_feedforward_layernorm"),
)
POST_NORMS = (("attn_post", "post_attention_layernorm"), ("mlp_post", "post_feedforward_layernorm"))
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class DecoderArch(LlamaArch):
    """LlamaArch's shape (its `sliding_window` left None: windows are per layer, in `layer_attention`) and:"""

    architecture: str = ""  # the HF architecture served, for messages
    norms: tuple[tuple[str, str], ...] = LLAMA_NORMS  # (role in NORM_ROLES, the checkpoint's name of that norm)
    norm_offset: bool = False  # Gemma's RMSNorm multiplies by (1 + w): folded into w at load
    activation: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_tanh (GeGLU)
    qk_norm: Optional[str] = None  # "head": each head's q and k (Gemma 3); "projection": all of q, all of k (OLMo 2)
    embedding_scale: Optional[float] = None  # Gemma: sqrt(hidden) (rounded to the model's dtype); Granite
    embedding_scale_in_dtype: bool = False  # Gemma rounds its scale to the model's dtype first
    residual_scale: float = 1.0  # Granite: residual + branch * residual_multiplier
    logits_divisor: float = 1.0  # Granite: logits / logits_scaling
    final_softcap: Optional[float] = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    layer_attention: tuple[LayerAttention, ...] = ()  # one per layer
    ropes: tuple[tuple[float, Optional[dict]], ...] = ()  # (theta, scaling) of each distinct RoPE
    layer_rope: tuple[int, ...] = ()  # per layer, its index in `ropes` (Gemma 3: local and global layers)
    rotary_dim: Optional[int] = None  # RoPE rotates each head's first rotary_dim dimensions (None: all; Phi-4-mini)

    def __post_init__(self):
        roles = [role for role, _ in self.norms]
        if not set(roles) <= set(NORM_ROLES) or self.activation not in ACTIVATIONS:
            raise ValueError(f"norm roles {roles} / activation {self.activation!r} unknown")
        if len(self.layer_attention) != self.num_layers or len(self.layer_rope) != self.num_layers:
            raise ValueError(f"{self.num_layers} layers need as many attention and RoPE entries")
