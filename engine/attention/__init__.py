"""Attention backends behind one interface: `cpu`, `torch` (the reference), `flash` and `triton` (CUDA)."""

from engine.attention.backend import AttentionBackend, get_attention_backend
from engine.attention.metadata import AttentionMetadata, PrefillChunk
from engine.attention.step_metadata import StepMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillChunk", "StepMetadata", "get_attention_backend"]
