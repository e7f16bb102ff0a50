"""The LoRA adapters a server serves, by name: what a request's `model` field (or its `lora` mix) picks, what
/v1/models lists, what the load and unload endpoints change.

    request {"model": "a"}                               -> ("a",    LoRAMix((("a", 1.0),)))
    request {"model": <base>, "lora": [{"name": "a", "scale": 0.7}, {"name": "b", "scale": 0.3}]}
                                                         -> (<base>, LoRAMix((("a", 0.7), ("b", 0.3))))
    request {"model": <base>} or no model                -> (<base>, None)
    (<base>: any of the --served-model-name names, reported as the request named it)

The engine's LoRA manager holds the weights (loaded, evicted and reloaded as it sees fit); this registry
holds what clients see: each adapter's name, directory and parent model. Names are checked here first, so an
unknown one is a 404 before any tokenizing; the engine checks again when the request reaches it (an unload
may come in between) and its LoRANotFoundError is the same 404.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from engine.errors import LoRANotFoundError
from engine.lora.lora_config import LoRAConfig
from engine.lora.request import LoRAMix, LoRARequest
from scheduler import RequestRejectedError
from server.http.errors import APIError, bad_request, model_not_found
from server.openai.protocol import LoRAPart

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdapterCard:
    """An adapter as /v1/models shows it: `root` is its directory, `parent` the base model id."""

    name: str
    path: str
    parent: str


def adapter_not_found(error: LoRANotFoundError, param: str = "model") -> APIError:
    """The 404 for an adapter the engine no longer has (unloaded after the server's own check)."""
    return APIError(404, f"The model {error.name!r} does not exist.", param=param, code="model_not_found")


class LoRAAdapters:
    """The adapters of a server started with --enable-lora; `load` and `unload` run on the event loop."""

    def __init__(self, engine: "AsyncEngine", base_names: Sequence[str], config: LoRAConfig):
        self._engine = engine
        self.base_names = tuple(base_names)  # every --served-model-name: each one is the base model
        self.base_name = base_names[0]
        self.config = config
        # the --lora-modules adapters: registered by the engine as it was built (the first --max-cpu-loras loaded)
        self._cards = {
            m.name: AdapterCard(m.name, m.path, m.base_model_name or self.base_name) for m in config.lora_modules
        }
        self._loading: set[str] = set()  # names whose load is under way: a second load of one is refused

    @property
    def cards(self) -> list[AdapterCard]:
        return list(self._cards.values())

    @property
    def names(self) -> list[str]:
        return list(self._cards)

    def card(self, name: str) -> Optional[AdapterCard]:
        return self._cards.get(name)

    async def load(self, name: str, path: str, base_model_name: Optional[str] = None) -> float:
        """Load the PEFT directory (or llama.cpp `.gguf` adapter) `path` as adapter `name`; the seconds it took.
        400 for a name already served (or being loaded), a rank over --max-lora-rank or an adapter the engine
        refuses; 404 when `path` holds no adapter."""
        if name in self.base_names:
            raise bad_request(f"{name!r} is the base model's name; give the adapter another.", param="lora_name")
        if name in self._cards or name in self._loading:
            raise bad_request(f"The lora adapter {name!r} has already been loaded.", param="lora_name")
        if not await asyncio.to_thread(os.path.exists, path):  # vLLM's 404 for a path that holds no adapter
            raise APIError(404, f"No adapter found for {name!r} at {path!r}.", param="lora_path")
        self._loading.add(name)
        started = time.perf_counter()
        try:
            await self._engine.add_lora(LoRARequest(name, path))
        except (RequestRejectedError, ValueError, OSError) as error:  # the rank limit, a bad config, bad weights
            problem = getattr(error, "problem", None) or str(error)
            raise bad_request(f"cannot load the LoRA adapter: {problem}", param="lora_path") from None
        finally:
            self._loading.discard(name)
        self._cards[name] = AdapterCard(name, path, base_model_name or self.base_name)
        return time.perf_counter() - started  # the engine's manager logs the load itself, with its time

    def unload(self, name: str) -> None:
        """Stop serving `name`: later requests for it get a 404; those already admitted finish. 404 if unknown."""
        if name not in self._cards:
            raise APIError(
                404, f"The lora adapter {name!r} cannot be found.", param="lora_name", code="model_not_found"
            )
        del self._cards[name]  # first: a request arriving during the engine's removal is a 404 already
        self._engine.remove_lora(name)
        logger.info("unloaded LoRA adapter %r", name)

    def resolve(self, requested: Optional[str], mix: Optional[Sequence[LoRAPart]]) -> tuple[str, Optional[LoRAMix]]:
        """The model id a response reports and the adapters a request runs with (None: the base alone)."""
        base = self.base_name if requested is None else requested
        if mix is not None:
            if base not in self.base_names:
                raise bad_request(
                    f"lora mixes adapters over the base model: set model to {self.base_name!r} (or leave it out), "
                    f"not {requested!r}.",
                    param="lora",
                )
            return base, self._mix(mix)
        if base in self.base_names:
            return base, None
        if base in self._cards:
            return base, LoRAMix(((base, 1.0),))
        raise model_not_found(base, [*self.base_names, *self._cards])

    def _mix(self, parts: Sequence[LoRAPart]) -> LoRAMix:
        """The mix as the engine takes it; its names checked here (404 before any tokenizing), its shape (at
        least one adapter, each once, at most --max-loras, finite scales) by the engine's LoRA manager."""
        for part in parts:
            if part.name not in self._cards:
                raise model_not_found(part.name, self.names, param="lora")
        return LoRAMix(tuple((part.name, part.scale) for part in parts))
