"""The adapters an engine serves: registered by name, loaded (LRU, `max_cpu_loras`), resolved for requests.

    add_lora (caller's thread) ---> registered + loaded          remove_lora: unregistered at once
    request's LoRAMix (engine thread) --resolve--> LoRARef       (requests already holding a LoRARef
         an adapter not loaded: a background load, the           keep its weights until they end)
         request waits beside the queue, resolve again later

Thread-safety: every public method takes the manager's lock; weights are read from disk outside it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

from engine.errors import InvalidParameterError, LoRAAdapterError, LoRANotFoundError
from engine.lora.adapter_source import AdapterSource
from engine.lora.lora_config import LoRAConfig
from engine.lora.gguf_adapter import GgufTarget, check_gguf_adapter, is_gguf_adapter, load_gguf_adapter
from engine.lora.peft_adapter import LoRAWeights, load_peft_adapter, read_adapter_config
from engine.lora.request import LoRAMix, LoRARequest

logger = logging.getLogger(__name__)


class LoadedLoRA(NamedTuple):
    """What `add_lora` loaded: the adapter, its largest rank and how long reading it took."""

    request: LoRARequest
    rank: int
    load_seconds: float


@dataclass(frozen=True, slots=True)
class LoRAStats:
    """For the `lora_requests_info` gauge: adapters of running and of waiting requests, and the slot count;
    `requests`: requests added per adapter since start."""

    running: list[str]
    waiting: list[str]
    max_loras: int
    requests: dict[str, int] = field(default_factory=dict)


class LoRARef(NamedTuple):
    """A request's resolved adapters (opaque to the scheduler, like a GrammarRef): the weights it runs with,
    held until it ends even if the adapter is unloaded meanwhile, each with its scale.

    `keys`: each adapter's identity (name and content hash): what the scheduler counts against max_loras and
    the runner gives a slot. `cache_key`: the mix's prefix-cache key (names, scales, contents).

    Pickled (a step message sent to worker ranks) each adapter travels as its AdapterSource: a worker reads its
    own part of the weights from the same files (engine/lora/adapter_source.py)."""

    mix: LoRAMix
    adapters: tuple[Union[LoRAWeights, AdapterSource], ...]
    keys: tuple[str, ...]
    cache_key: bytes

    def __reduce__(self) -> tuple[Any, ...]:
        sources = tuple(a if isinstance(a, AdapterSource) else AdapterSource.of(a) for a in self.adapters)
        return LoRARef, (self.mix, sources, self.keys, self.cache_key)

    @property
    def scales(self) -> tuple[float, ...]:
        return tuple(scale for _, scale in self.mix.parts)

    @property
    def replaces_embeddings(self) -> bool:
        return any(isinstance(a, LoRAWeights) and (a.embed is not None or a.lm_head is not None) for a in self.adapters)


def adapter_key(adapter: LoRAWeights) -> str:
    return f"{adapter.name}@{adapter.content_hash.hex()[:16]}"


class LoRAManager:
    """Registered and loaded adapters of one engine (EngineCore.lora_manager)."""

    def __init__(self, config: LoRAConfig, num_layers: int, gguf_target: Optional[GgufTarget] = None):
        """`gguf_target`: the base's type and heads, which llama.cpp's adapter files are read against (None:
        they are refused)."""
        self.config = config
        self.num_layers = num_layers
        self.gguf_target = gguf_target
        self.max_loras = config.max_loras
        self.capacity = config.cpu_capacity
        self._lock = threading.Lock()
        self._registered: dict[str, LoRARequest] = {}
        self._loaded: OrderedDict[str, LoRAWeights] = OrderedDict()  # least recently used first
        self._loading: dict[str, Future] = {}
        self._failed: dict[str, BaseException] = {}  # a background load's error, until the name is re-added
        self._executor: Optional[ThreadPoolExecutor] = None  # started on the first cold load
        self._active: frozenset[str] = frozenset()  # names of unfinished requests' adapters (record_activity)
        self._activity = LoRAStats([], [], config.max_loras)
        self._request_counts: dict[str, int] = {}

    # ------------------------------------------------------------------ registration (any thread)

    def add_lora(self, request: LoRARequest) -> LoadedLoRA:
        """Register and load a PEFT directory or a llama.cpp GGUF file (validated: rank, targets, DoRA);
        idempotent by name (the same path again returns the loaded adapter; another path under a taken name is
        refused)."""
        with self._lock:
            known = self._registered.get(request.name)
            if known is not None and known.path != request.path:
                raise LoRAAdapterError(request.name, f"the name is taken by {known.path!r}; unload it first")
            loaded = self._loaded.get(request.name) if known is not None else None
            if loaded is not None:
                return LoadedLoRA(request, loaded.rank, 0.0)
        started = time.monotonic()
        weights = self._read(request)
        seconds = time.monotonic() - started
        with self._lock:
            self._registered[request.name] = request
            self._failed.pop(request.name, None)
            self._store(weights)
        logger.info(
            "loaded LoRA adapter %r (rank %d) from %s in %.3f s", request.name, weights.rank, request.path, seconds
        )
        return LoadedLoRA(request, weights.rank, seconds)

    def register(self, request: LoRARequest) -> None:
        """Register without loading (validated by its config only): loaded by the first request naming it."""
        if is_gguf_adapter(request.path):
            check_gguf_adapter(request.name, request.path, *self._gguf_args(request.name))
        else:
            read_adapter_config(request.name, Path(request.path), self.config.max_lora_rank)
        with self._lock:
            self._registered[request.name] = request

    def remove_lora(self, name: str) -> bool:
        """Unregister `name`: later requests are refused (LoRANotFoundError); requests already holding it run
        to their end with its weights. False when no such adapter was registered."""
        with self._lock:
            if self._registered.pop(name, None) is None:
                return False
            self._loaded.pop(name, None)
            self._failed.pop(name, None)
            return True

    def list_loras(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._registered.values())

    def loaded_names(self) -> list[str]:
        """The adapters whose weights are in memory, least recently used first."""
        with self._lock:
            return list(self._loaded)

    def stats(self) -> LoRAStats:
        with self._lock:
            return LoRAStats(
                list(self._activity.running), list(self._activity.waiting), self.max_loras, dict(self._request_counts)
            )

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    # ------------------------------------------------------------------ the engine thread

    def check(self, mix: LoRAMix) -> None:
        """Refuse a mix that can never run: an unknown name, a bad scale, more adapters than slots."""
        if not mix.parts:
            raise InvalidParameterError("lora", "must name at least one adapter")
        names = mix.names
        if len(set(names)) != len(names):
            raise InvalidParameterError("lora", f"names an adapter twice: {list(names)}")
        if len(names) > self.max_loras:
            raise InvalidParameterError("lora", f"mixes {len(names)} adapters, above max_loras {self.max_loras}")
        for name, scale in mix.parts:
            if not isinstance(scale, (int, float)) or not math.isfinite(scale):
                raise InvalidParameterError("lora", f"scale of {name!r} must be a finite number, got {scale!r}")
        with self._lock:
            for name in names:
                if name not in self._registered:
                    raise LoRANotFoundError(name)

    def count_request(self, mix: LoRAMix) -> None:
        """One more request accepted for each adapter of `mix` (the per-adapter request counter)."""
        with self._lock:
            for name in mix.names:
                self._request_counts[name] = self._request_counts.get(name, 0) + 1

    def resolve(self, mix: LoRAMix) -> Optional[LoRARef]:
        """The mix's weights when every adapter is loaded; else starts loading the missing ones in the
        background and returns None (ask again later). Raises LoRANotFoundError for a name unloaded since, and
        a failed background load's error."""
        missing = []
        with self._lock:
            adapters = []
            for name in mix.names:
                if name not in self._registered:
                    raise LoRANotFoundError(name)
                if name in self._failed:
                    raise self._failed[name]
                weights = self._loaded.get(name)
                if weights is None:
                    missing.append(name)
                    continue
                self._loaded.move_to_end(name)
                adapters.append(weights)
            for name in missing:
                if name not in self._loading:
                    self._loading[name] = self._start_load(self._registered[name])
        if missing:
            return None
        if len(adapters) > 1 and any(a.embed is not None or a.lm_head is not None for a in adapters):
            # A weighted mix of whole replacement matrices has no reference to match: PEFT's add_weighted_adapter
            # refuses two adapters that replace the same module and, with one, serves the base's matrix (its
            # replacement dropped), which is not what that adapter was trained to give.
            raise InvalidParameterError(
                "lora",
                "an adapter with modules_to_save (embed_tokens, lm_head) runs alone: a weighted mix of replacement "
                "matrices is not defined (PEFT's add_weighted_adapter refuses it or drops the replacement)",
            )
        return LoRARef(mix, tuple(adapters), tuple(adapter_key(a) for a in adapters), _cache_key(mix, adapters))

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to `timeout` seconds for a background load to end (an engine with nothing else to do)."""
        with self._lock:
            pending = list(self._loading.values())
        if pending:
            wait(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    @property
    def is_loading(self) -> bool:
        with self._lock:
            return bool(self._loading)

    def record_activity(self, running: list[str], waiting: list[str]) -> None:
        """The adapters of running and waiting requests now (the engine, after each step): the gauge's labels,
        and which adapters are idle (evictable)."""
        with self._lock:
            self._activity = LoRAStats(running, waiting, self.max_loras)
            self._active = frozenset(running) | frozenset(waiting)

    # ------------------------------------------------------------------ internals

    def _read(self, request: LoRARequest) -> LoRAWeights:
        """A PEFT directory's adapter, or a llama.cpp GGUF file's."""
        if is_gguf_adapter(request.path):
            return load_gguf_adapter(request.name, request.path, *self._gguf_args(request.name))
        return load_peft_adapter(request.name, request.path, self.config.max_lora_rank, self.num_layers)

    def _gguf_args(self, name: str) -> tuple[int, int, GgufTarget]:
        if self.gguf_target is None:
            raise LoRAAdapterError(name, "GGUF adapters are not read by this engine (no base shape given)")
        return self.config.max_lora_rank, self.num_layers, self.gguf_target

    def _start_load(self, request: LoRARequest) -> Future:
        """Read `request`'s adapter on the loading thread (called under the lock: the future's work, storing
        included, always runs on that thread, never inline here)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        return self._executor.submit(self._load_in_background, request)

    def _load_in_background(self, request: LoRARequest) -> None:
        try:
            weights: Optional[LoRAWeights] = self._read(request)
            error: Optional[BaseException] = None
        except Exception as exc:  # noqa: BLE001 - kept for the requests waiting on it
            weights, error = None, exc
        with self._lock:
            self._loading.pop(request.name, None)
            if self._registered.get(request.name) != request:
                return  # unloaded (or replaced) while it loaded
            if error is not None:
                logger.error("loading LoRA adapter %r failed: %s", request.name, error)
                self._failed[request.name] = error
                return
            assert weights is not None
            self._store(weights)
        logger.info("loaded LoRA adapter %r in the background", request.name)

    def _store(self, weights: LoRAWeights) -> None:
        """Keep `weights` loaded (under the lock), evicting least recently used idle adapters over capacity."""
        self._loaded[weights.name] = weights
        self._loaded.move_to_end(weights.name)
        for name in list(self._loaded):
            if len(self._loaded) <= self.capacity:
                break
            if name != weights.name and name not in self._active:
                del self._loaded[name]
                logger.info("evicted LoRA adapter %r (least recently used; max_cpu_loras %d)", name, self.capacity)


def _cache_key(mix: LoRAMix, adapters: list[LoRAWeights]) -> bytes:
    digest = hashlib.sha256(b"lora")
    for (name, scale), adapter in zip(mix.parts, adapters):
        digest.update(name.encode() + b"\0" + struct.pack("<d", float(scale)) + adapter.content_hash)
    return digest.digest()
