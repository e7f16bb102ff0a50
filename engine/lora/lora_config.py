"""The LoRA section of the engine's configuration (vLLM's names)."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LoRAModule(BaseModel):
    """An adapter served from start-up: `name` is the `model` clients ask for, `path` a PEFT directory
    (adapter_config.json + adapter_model.safetensors) or a llama.cpp LoRA adapter file (`.gguf`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    base_model_name: Optional[str] = None


class LoRAConfig(BaseModel):
    """Adapters applied per request beside the base weights (engine/lora/)."""

    model_config = ConfigDict(extra="forbid")

    enable_lora: bool = Field(False, description="serve LoRA adapters beside the base model")
    max_loras: int = Field(
        4, ge=1, description="distinct adapters in one step's batch at most (each holds a slot of stacked weights)"
    )
    max_lora_rank: int = Field(16, ge=1, description="the largest adapter rank accepted (slots are padded to it)")
    max_cpu_loras: Optional[int] = Field(
        None,
        ge=1,
        description="adapters kept loaded in memory, least recently used evicted when idle (None: max_loras)",
    )
    lora_modules: list[LoRAModule] = Field(default_factory=list, description="adapters registered at start-up")
    allow_runtime_lora_updating: bool = Field(
        False, description="allow loading and unloading adapters while serving (the load/unload endpoints)"
    )

    @model_validator(mode="after")
    def _check(self) -> "LoRAConfig":
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): "
                "every adapter of a step is loaded"
            )
        names = [module.name for module in self.lora_modules]
        if names and not self.enable_lora:  # (they would be ignored: a request naming one would get a 404)
            raise ValueError(f"lora_modules ({', '.join(names)}) need enable_lora (--enable-lora)")
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must be distinct, got {names}")
        return self

    @property
    def cpu_capacity(self) -> int:
        """Adapters kept loaded at most."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
