"""The shape of a model's attention: what a kernel's start-up probe must run to say it serves the model."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional


class AttentionShape(NamedTuple):
    """Query heads, KV heads and the head dimension of every layer.

    Multi-head latent attention (DeepSeek-V2/V3) attends, absorbed, as one KV head over the latent entries:
    `head_dim` = kv_lora_rank + qk_rope_head_dim, the values being their first kv_lora_rank (`latent_rank_of`)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, config: Any) -> "AttentionShape":
        num_heads = config.num_attention_heads
        latent_rank = latent_rank_of(config)
        if latent_rank is not None:
            return cls(num_heads=num_heads, num_kv_heads=1, head_dim=latent_rank + config.qk_rope_head_dim)
        return cls(
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        )


def latent_rank_of(config: Any) -> Optional[int]:
    """The width of the latent a config's multi-head latent attention caches (`kv_lora_rank`); None: not MLA."""
    return getattr(config, "kv_lora_rank", None)
