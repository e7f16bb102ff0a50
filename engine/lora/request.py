"""How a request names its adapter: one, or a weighted mix of several."""

from __future__ import annotations

from typing import NamedTuple


class LoRARequest(NamedTuple):
    """An adapter to register: `name` (what clients ask for) and `path` (a PEFT directory or a llama.cpp
    `.gguf` adapter).

    vLLM's `lora_name` / `lora_path`; the manager assigns its internal id."""

    name: str
    path: str


class LoRAMix(NamedTuple):
    """The adapters a request runs with: (adapter name, scale) pairs, each delta scaled and summed.

    A plain single adapter is `LoRAMix(((name, 1.0),))` (`LoRAMix.single(name)`)."""

    parts: tuple[tuple[str, float], ...]

    @classmethod
    def single(cls, name: str) -> "LoRAMix":
        return cls(((name, 1.0),))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.parts)
