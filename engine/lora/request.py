"""How a request names its adapter: one, or a weighted mix of several."""

from __future__ import annotations

import os
from typing import NamedTuple, Optional


class _NamedAdapter(NamedTuple):
    name: str
    path: str


class LoRARequest(_NamedAdapter):
    """An adapter to register: `name` (what clients ask for) and `path` (a PEFT directory or a llama.cpp
    `.gguf` adapter): `LoRARequest(name, path)`.

    vLLM's spelling works as written: `LoRARequest("sql", 1, "/path")` or `LoRARequest(lora_name=...,
    lora_int_id=..., lora_path=...)`; the id is not kept (the manager assigns its own)."""

    __slots__ = ()

    def __new__(
        cls,
        *args: object,
        name: Optional[str] = None,
        path: Optional[str] = None,
        lora_name: Optional[str] = None,
        lora_int_id: Optional[int] = None,
        lora_path: Optional[str] = None,
        lora_local_path: Optional[str] = None,
        **vllm_fields: object,  # (base_model_name, long_lora_max_len, ...: nothing this server reads)
    ) -> "LoRARequest":
        if len(args) >= 2 and isinstance(args[1], int) and not isinstance(args[1], bool):
            args = (args[0], *args[2:])  # vLLM's (lora_name, lora_int_id, lora_path)
        if len(args) > 2:
            raise TypeError(f"LoRARequest takes a name and a path, got {len(args)} positional arguments")
        given: dict[str, object] = dict(zip(("name", "path"), args))
        for key, value in (("name", name if name is not None else lora_name), ("path", path)):
            if value is not None:
                given[key] = value
        if not given.get("path") and (lora_path or lora_local_path):  # (vLLM reads the local path when the
            given["path"] = lora_path or lora_local_path  # path is empty)
        adapter_name, adapter_path = given.get("name"), given.get("path")
        if isinstance(adapter_path, os.PathLike):
            adapter_path = os.fspath(adapter_path)
        if not isinstance(adapter_name, str) or not isinstance(adapter_path, str) or not adapter_path:
            raise TypeError("LoRARequest needs a name and a path (a string or a path)")
        return super().__new__(cls, adapter_name, adapter_path)

    @property
    def lora_name(self) -> str:
        return self.name

    @property
    def lora_path(self) -> str:
        return self.path


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
