"""The shape of a model's attention: what a kernel's start-up probe must run to say it serves the model."""

from __future__ import annotations

from typing import Any, NamedTuple


class AttentionShape(NamedTuple):
    """Query heads, KV heads and the head dimension of every layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, config: Any) -> "AttentionShape":
        num_heads = config.num_attention_heads
        return cls(num_heads=num_heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads)
