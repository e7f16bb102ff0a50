"""The adapters an engine serves: registered by name, loaded (LRU, `max_cpu_loras`), resolved for requests.

    add_lora (caller's thread) ---> registered + loaded          remove_lora: unregistered at once
    request's LoRAMix (engine thread) --resolve--> LoRARef       (requests already holding a LoRARef
         an adapter not loaded: a load in slices between         keep its weights until they end)
         steps (advance_loads); the request waits beside
         the queue, resolve again later

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
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, NamedTuple, Optional, Union

import torch

from engine.errors import InvalidParameterError, LoRAAdapterError, LoRANotFoundError
from engine.lora.adapter_source import AdapterSource
from engine.lora.lora_config import LoRAConfig
from engine.lora.gguf_adapter import GgufTarget, check_gguf_adapter, is_gguf_adapter, load_gguf_adapter
from engine.lora.adapter_layout import AdapterLayout
from engine.lora.peft_adapter import LoRAWeights, drain, load_peft_steps, read_adapter_config
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

    def __init__(
        self,
        config: LoRAConfig,
        num_layers: int,
        gguf_target: Optional[GgufTarget] = None,
        dtype: torch.dtype = torch.float32,
        layout: AdapterLayout = AdapterLayout(),
    ):
        """`gguf_target`: the base's type and heads, which llama.cpp's adapter files are read against (None:
        they are refused). `dtype`: the slot stacks', which PEFT adapters are converted to as they load.
        `layout`: how the family's module names map onto the model's projections (adapter_layout.py)."""
        self.config = config
        self.dtype = dtype
        self.num_layers = num_layers
        self.gguf_target = gguf_target
        self.layout = layout
        self.max_loras = config.max_loras
        self.capacity = config.cpu_capacity
        self._lock = threading.Lock()
        self._registered: dict[str, LoRARequest] = {}
        self._loaded: OrderedDict[str, LoRAWeights] = OrderedDict()  # least recently used first
        self._loading: dict[str, _Load] = {}  # loads in progress, slice by slice (advance_loads)
        self._fresh: frozenset[str] = frozenset()  # finished by the latest advance_loads: admitted a step later
        self._failed: dict[str, BaseException] = {}  # a background load's error, until the name is re-added
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
        weights = drain(self._load_steps(request))
        seconds = time.monotonic() - started
        with self._lock:
            self._registered[request.name] = request
            self._failed.pop(request.name, None)
            self._store(weights)
        logger.info(
            "loaded LoRA adapter %r (rank %d) from %s in %.3f s", request.name, weights.rank, request.path, seconds
        )
        return LoadedLoRA(request, weights.rank, seconds)

    def begin_load(self, request: LoRARequest) -> "Future[LoadedLoRA]":
        """`add_lora` done by the engine thread between its steps (advance_loads), for a caller beside a running
        engine (POST /v1/load_lora_adapter): the future ends with the adapter registered and loaded, or with its
        error (nothing registered). A name taken by another path is refused at once."""
        future: Future[LoadedLoRA] = Future()
        with self._lock:
            known = self._registered.get(request.name)
            if known is not None and known.path != request.path:
                raise LoRAAdapterError(request.name, f"the name is taken by {known.path!r}; unload it first")
            loaded = self._loaded.get(request.name) if known is not None else None
            if loaded is not None:
                future.set_result(LoadedLoRA(request, loaded.rank, 0.0))
                return future
            load = self._loading.get(request.name)
            if load is None or load.request != request:
                load = self._loading[request.name] = _Load(request, self._load_steps(request), registers=True)
            load.callers.append(future)
        return future

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
                if weights is None or name in self._fresh:
                    # (one finished in this step waits a step: its last slice and its slot copy in different steps)
                    missing.append(name)
                    continue
                self._loaded.move_to_end(name)
                adapters.append(weights)
            for name in missing:
                if name not in self._loading and name not in self._loaded:
                    request = self._registered[name]
                    self._loading[name] = _Load(request, self._load_steps(request))
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

    def advance_loads(self, budget_seconds: float) -> None:
        """Advance the loads in progress on the calling (engine) thread for about `budget_seconds` (slice by
        slice: peft_adapter.load_peft_steps) and keep the finished ones. Why here, between steps, and not on a
        loading thread: on a CPU the step's OpenMP team holds every core, and a team thread that loses its core
        stalls the whole step (every parallel region waits for its slowest thread): reading a 10 MB adapter
        (~8 ms of one core) beside a step stretched that step 3-4x, a parse beside the steps at equal priority
        more, and at idle priority the load starved for seconds. A slice between steps costs the running
        streams only its own milliseconds."""
        deadline = time.monotonic() + budget_seconds
        with self._lock:
            self._fresh = frozenset()
            jobs = list(self._loading.items())
        fresh = []
        for name, load in jobs:
            try:
                next(load.steps)  # at least a slice per call: every load moves
                while time.monotonic() < deadline:
                    next(load.steps)
                continue  # the budget is spent: the rest in later steps
            except StopIteration as done:
                weights: Optional[LoRAWeights] = done.value
                error: Optional[BaseException] = None
            except Exception as exc:  # noqa: BLE001 - kept for the requests waiting on it
                weights, error = None, exc
            seconds = time.monotonic() - load.started
            with self._lock:
                if self._loading.get(name) is load:
                    del self._loading[name]
                known = self._registered.get(name)
                if error is not None:
                    logger.error("loading LoRA adapter %r failed: %s", name, error)
                    if known == load.request:
                        self._failed[name] = error
                elif load.registers and (known is None or known == load.request):
                    self._registered[name] = load.request
                    self._failed.pop(name, None)
                elif known != load.request:
                    error = LoRANotFoundError(name)  # unloaded (or replaced) while it loaded
                if error is None:
                    assert weights is not None
                    self._store(weights)
                    fresh.append(name)
            for caller in load.callers:
                if error is None:
                    assert weights is not None
                    caller.set_result(LoadedLoRA(load.request, weights.rank, seconds))
                else:
                    caller.set_exception(error)
            if error is None:
                assert weights is not None
                logger.info(
                    "loaded LoRA adapter %r (rank %d) from %s in %.3f s, between steps",
                    name,
                    weights.rank,
                    load.request.path,
                    seconds,
                )
        with self._lock:
            self._fresh = frozenset(fresh)

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
            if len(self._loaded) > self.capacity:  # a burst over busy adapters left more loaded than max_cpu_loras
                self._evict_idle(keep=None)

    # ------------------------------------------------------------------ internals

    def _gguf_args(self, name: str) -> tuple[int, int, GgufTarget]:
        if self.gguf_target is None:
            raise LoRAAdapterError(name, "GGUF adapters are not read by this engine (no base shape given)")
        return self.config.max_lora_rank, self.num_layers, self.gguf_target

    def _load_steps(self, request: LoRARequest) -> LoadSteps:
        if is_gguf_adapter(request.path):
            return _whole(lambda: load_gguf_adapter(request.name, request.path, *self._gguf_args(request.name)))
        max_rank = self.config.max_lora_rank
        return load_peft_steps(request.name, request.path, max_rank, self.num_layers, self.dtype, self.layout)

    def _store(self, weights: LoRAWeights) -> None:
        """Keep `weights` loaded (under the lock), evicting least recently used idle adapters over capacity."""
        self._loaded[weights.name] = weights
        self._loaded.move_to_end(weights.name)
        self._evict_idle(keep=weights.name)

    def _evict_idle(self, keep: Optional[str]) -> None:
        """Down to `capacity` loaded adapters (under the lock), least recently used first, never one that a
        running or waiting request names nor `keep`: busy ones stay over capacity until they are idle."""
        for name in list(self._loaded):
            if len(self._loaded) <= self.capacity:
                break
            if name != keep and name not in self._active:
                del self._loaded[name]
                logger.info("evicted LoRA adapter %r (least recently used; max_cpu_loras %d)", name, self.capacity)


LoadSteps = Generator[None, None, LoRAWeights]
"""A load in slices: yields between them, returns the adapter."""


@dataclass(slots=True)
class _Load:
    """A load in progress: for a registered adapter (a request named it), or, with `registers`, for a caller of
    `begin_load` (registered when it succeeds); `callers` get its result."""

    request: LoRARequest
    steps: LoadSteps
    registers: bool = False
    callers: list["Future[LoadedLoRA]"] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


def _whole(read: Callable[[], LoRAWeights]) -> LoadSteps:
    """A read that has no slices, as one (a GGUF adapter's: its reader maps the file and converts tensor by
    tensor)."""
    yield
    return read()


def _cache_key(mix: LoRAMix, adapters: list[LoRAWeights]) -> bytes:
    digest = hashlib.sha256(b"lora")
    for (name, scale), adapter in zip(mix.parts, adapters):
        digest.update(name.encode() + b"\0" + struct.pack("<d", float(scale)) + adapter.content_hash)
    return digest.digest()
