"""Requests whose adapters are still loading: held beside the scheduler's queue until their weights are in.

A cold adapter is read and parsed in slices between steps (LoRAManager.advance_loads); meanwhile
the step loop goes on with the other requests, and each step moves the requests whose adapters are ready into the
scheduler (in arrival order).
"""

from __future__ import annotations

from typing import Callable, Optional

from engine.lora.lora_manager import LoRAManager, LoRARef
from engine.lora.request import LoRAMix
from scheduler import Request

IDLE_LOAD_SLICE_SECONDS = 0.05
"""How long an engine with nothing else to run advances a load before looking at its commands again."""

LOAD_SLICE_SECONDS = 0.004
"""The least each step spends advancing a cold adapter's load while other requests run (LoRAManager.advance_loads)."""

LOAD_STEP_SHARE = 1 / 3
"""...and the share of the step before it it may take: a load then stretches the running streams' gaps by about a
third and finishes in a few steps whatever the model's step time (a fixed slice spread a small model's load over
many short steps, and barely moved on a larger model's long ones; figures in docs/performance.md)."""


def load_budget(busy: bool, last_step_seconds: float) -> float:
    """Seconds of load work to run before the next step (IDLE_LOAD_SLICE_SECONDS when nothing else runs)."""
    if not busy:
        return IDLE_LOAD_SLICE_SECONDS
    return max(LOAD_SLICE_SECONDS, LOAD_STEP_SHARE * last_step_seconds)


def attach(request: Request, ref: LoRARef) -> None:
    """Give the scheduler's request its adapters: the weights, the slot keys and the prefix-cache key."""
    request.lora = ref
    request.lora_adapters = ref.keys
    request.lora_key = ref.cache_key


def adapter_names(request: Request) -> tuple[str, ...]:
    """The adapter names of a scheduler request (empty for the base model)."""
    return request.lora.mix.names if isinstance(request.lora, LoRARef) else ()


class LoRAWaitingRequests:
    """Requests (validated, not yet queued) waiting for a background adapter load, oldest first."""

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[Request, LoRAMix]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting

    def add(self, request: Request, mix: LoRAMix) -> None:
        self._waiting[request.request_id] = (request, mix)

    def remove(self, request_id: str) -> Optional[Request]:
        entry = self._waiting.pop(request_id, None)
        return None if entry is None else entry[0]

    def names(self) -> list[str]:
        return [name for _, mix in self._waiting.values() for name in mix.names]

    def admit_ready(
        self, manager: LoRAManager, queue: Callable[[Request], None], fail: Callable[[str, BaseException], None]
    ) -> None:
        """Queue every request whose adapters are loaded now (`queue`); `fail` those whose load failed or whose
        adapter was unloaded meanwhile."""
        for request_id, (request, mix) in list(self._waiting.items()):
            try:
                ref = manager.resolve(mix)
            except Exception as error:  # noqa: BLE001 - the request fails alone
                del self._waiting[request_id]
                fail(request_id, error)
                continue
            if ref is not None:
                del self._waiting[request_id]
                attach(request, ref)
                queue(request)
