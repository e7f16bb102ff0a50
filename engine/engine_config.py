"""The engine's configuration: the model, cache and scheduler sections together."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.cache_config import EngineCacheConfig
from engine.loading.model_config import ModelConfig
from scheduler import SchedulerConfig


class EngineConfig(BaseModel):
    """Everything `EngineCore.from_config` needs; each section is owned by its package."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: EngineCacheConfig = Field(default_factory=EngineCacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    attention_backend: Literal["auto", "cpu", "torch", "flash", "triton"] = "auto"
