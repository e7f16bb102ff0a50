"""What the routes share, kept on `app.state.server` (no module-level state)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional

from engine.async_engine import AsyncEngine
from server.serving.admission import Admission
from server.serving.lora_adapters import LoRAAdapters
from engine.text.tokenizer import Tokenizer
from server.config.server_config import ServerConfig
from server.openai.chat_templates import ChatTemplates
from server.openai.logprob_format import LogprobFormatter
from server.observability.metrics import ServerMetrics


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    served_model_names: list[str]
    metrics: ServerMetrics
    formatter: LogprobFormatter
    admission: Admission
    templates: ChatTemplates  # which chat template a request renders with, and how
    ready: bool = False
    draining: bool = False  # shutting down: new generation requests get a 503
    # generation requests past the draining check and not yet queued in the engine (rendering, compiling their
    # grammar): the drain waits for them too, as they came in before it began
    preparing: int = 0
    adapters: Optional[LoRAAdapters] = None  # with --enable-lora: the adapters a request's model may name
    # use_beam_search's searches still running (serving/beam_search.py): in flight between their steps too,
    # when none of their engine requests is
    beam_searches: set[asyncio.Task] = field(default_factory=set)

    @property
    def model_ids(self) -> list[str]:
        """Every id a request's `model` may name: the served model's, then the LoRA adapters'."""
        return [*self.served_model_names, *(self.adapters.names if self.adapters is not None else ())]

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len
