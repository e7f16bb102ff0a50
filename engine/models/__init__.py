"""Model implementations, chosen from the HF config."""

from engine.models.registry import build_model, supported_architectures

__all__ = ["build_model", "supported_architectures"]
