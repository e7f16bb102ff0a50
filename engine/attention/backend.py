"""The attention backend interface and its selection."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Paged attention over a KV cache laid out per layer as
    `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V."""

    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """Store the new tokens' K/V at `metadata.slot_mapping`."""
        ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (this step's, already written)
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of each query over its request's cached and new tokens."""
        ...


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks flash-attn on CUDA when it imports, else the torch backend."""
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            try:
                import flash_attn  # noqa: F401
            except ImportError:
                pass
            else:
                name = "flash"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name in ("flash", "triton"):
        raise ValueError(f"attention backend {name!r} is not available in this build yet; use 'torch'")
    raise ValueError(f"unknown attention backend {name!r} (choose auto, torch)")
