"""The shape of a Llama-family model, read from its HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from engine.attention.attention_shape import AttentionShape
from engine.loading.rope_settings import mrope_section


@dataclass(frozen=True, slots=True)
class LlamaArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: Optional[int]
    # Which layers slide when `sliding_window` is set (HF's `layer_types`: Qwen2/3 slide only from
    # max_window_layers on); () = every layer.
    sliding_layers: tuple[bool, ...] = ()
    # Multimodal RoPE (Qwen2-VL): each head's rotary pairs in sections rotated by a position's temporal, height and
    # width component in turn (engine/layers/mrope.py); None: one position per token
    mrope_section: Optional[tuple[int, ...]] = None

    @property
    def layer_windows(self) -> tuple[Optional[int], ...]:
        """Each layer's sliding window (None: full attention)."""
        slides = self.sliding_layers or (True,) * self.num_layers
        return tuple(self.sliding_window if slide else None for slide in slides)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Any, rope: tuple[float, Optional[dict]]) -> "LlamaArch":
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        sliding_window = getattr(config, "sliding_window", None)
        if config.model_type in ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text") and not getattr(
            config, "use_sliding_window", False
        ):
            sliding_window = None
        if config.model_type == "qwen3" and not getattr(config, "use_sliding_window", False):
            sliding_window = None
        if config.model_type in ("qwen2_moe", "qwen3_moe") and not getattr(config, "use_sliding_window", False):
            sliding_window = None  # qwen2_moe writes 0 there when off
        layer_types = getattr(config, "layer_types", None) if sliding_window is not None else None
        sliding_layers = () if layer_types is None else tuple(kind == "sliding_attention" for kind in layer_types)
        return cls(
            **shared_fields(config, rope),
            sliding_window=sliding_window,
            sliding_layers=sliding_layers,
            mrope_section=mrope_section(config),
        )


def shared_fields(
    config: Any,
    rope: tuple[float, Optional[dict]],
    norm_eps: Optional[float] = None,
    intermediate_size: Optional[int] = None,
) -> dict[str, Any]:
    """The fields every decoder family reads the same way from its HF config (all but its sliding window);
    `norm_eps`: the norms' epsilon where the config names it otherwise than rms_norm_eps (Cohere's layer_norm_eps);
    `intermediate_size`: the MLP's width where it is not the config's intermediate_size (GPT-J's n_inner)."""
    shape = AttentionShape.from_hf_config(config)  # what the attention backend was chosen for
    return dict(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size if intermediate_size is None else intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=config.rms_norm_eps if norm_eps is None else norm_eps,
        rope_theta=rope[0],
        rope_scaling=rope[1],
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )
