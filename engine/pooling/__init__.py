"""Pooling requests (embeddings): a prompt's final hidden states pooled into one vector, nothing sampled."""

from engine.pooling.params import Pooling, PoolingParams, PoolingType
from engine.pooling.pooler_config import ModelPooler, PoolerConfig

__all__ = ["ModelPooler", "Pooling", "PoolerConfig", "PoolingParams", "PoolingType"]
