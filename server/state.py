"""What the routes share, kept on `app.state.server` (no module-level state)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.async_engine import AsyncEngine
from server.serving.admission import Admission
from engine.text.tokenizer import Tokenizer
from server.config.server_config import ServerConfig
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
    ready: bool = False
    draining: bool = False  # shutting down: new generation requests get a 503

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len
