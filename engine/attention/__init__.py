"""Attention backends behind one interface: `torch` (CPU and reference) today; `flash` and `triton` on CUDA."""

from engine.attention.backend import AttentionBackend, get_attention_backend
from engine.attention.metadata import AttentionMetadata, PrefillChunk

__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillChunk", "get_attention_backend"]
