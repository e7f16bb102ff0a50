"""Which stacked slot holds which adapter while the runner's requests use it.

The scheduler admits at most max_loras distinct adapters across running requests, so a request's adapters
always find slots. An adapter keeps its slot while any request uses it, and after that until the slot is
needed (a request of the same adapter later finds its weights still in place: no copy). A new adapter takes
the lowest free slot, keeping the slots of a step together (LoRAStep multiplies [lo, hi) as one view).
"""

from __future__ import annotations

from typing import Optional

from engine.lora.adapter_source import AdapterSource, read_source
from engine.lora.gguf_adapter import GgufTarget
from engine.lora.lora_manager import LoRARef
from engine.lora.lora_stack import LoRAStack
from engine.lora.peft_adapter import LoRAWeights


class LoRASlots:
    """Slot assignment over a LoRAStack, with per-slot use counts."""

    def __init__(self, stack: LoRAStack):
        self.stack = stack
        self._keys: list[Optional[str]] = [None] * stack.max_loras  # the adapter each slot holds
        self._users = [0] * stack.max_loras  # requests using it now

    def acquire(self, ref: LoRARef) -> tuple[tuple[int, float], ...]:
        """Slots for a request's adapters (loading those not in one), each with its scale. A worker rank's
        request names its adapters' sources: read here, when a slot first takes one (LoRAAdapterError when the
        files are gone or changed since rank 0 read them)."""
        slots = []
        for key, adapter, scale in zip(ref.keys, ref.adapters, ref.scales):
            slot = self._slot_of(key)
            if slot is None:
                slot = self._free_slot()
                self.stack.load(slot, adapter if isinstance(adapter, LoRAWeights) else self._read(adapter))
                self._keys[slot] = key
            self._users[slot] += 1
            slots.append((slot, float(scale)))
        return tuple(slots)

    def release(self, slots: tuple[tuple[int, float], ...]) -> None:
        for slot, _ in slots:
            assert self._users[slot] > 0, f"LoRA slot {slot} released more often than acquired"
            self._users[slot] -= 1

    @property
    def num_in_use(self) -> int:
        return sum(1 for users in self._users if users)

    def _read(self, source: AdapterSource) -> LoRAWeights:
        stack = self.stack
        whole = stack.arch if stack.shard is None else stack.shard.whole
        return read_source(source, stack.max_rank, whole.num_layers, GgufTarget.of(whole), stack.layout)

    def _slot_of(self, key: str) -> Optional[int]:
        try:
            return self._keys.index(key)
        except ValueError:
            return None

    def _free_slot(self) -> int:
        idle = [slot for slot, users in enumerate(self._users) if not users]
        if not idle:
            raise RuntimeError(
                f"all {len(self._users)} LoRA slots are in use: the scheduler admitted more than max_loras adapters"
            )
        return idle[0]  # the lowest, even over a cached adapter: a copy costs less than a wider range every step
