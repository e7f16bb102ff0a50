"""LoRA metrics (with --enable-lora), read from the engine's LoRA manager at scrape time, so they are exact:

    pagedserve_lora_requests_info{model_name, max_lora, waiting_lora_adapters, running_lora_adapters} <unix time>
    pagedserve_lora_requests_total{model_name, lora_name}

The info gauge is vLLM's `vllm:lora_requests_info` under our prefix, with its label names and its value (the
time of the reading, so a dashboard takes the newest series); adapter lists are comma-separated and sorted.
The counter counts the requests the engine took with each adapter (every adapter of a mix counts once).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from engine.lora.lora_manager import LoRAStats


class LoRACollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], Optional["LoRAStats"]]):
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterable:
        stats = self._stats()
        if stats is None:  # an engine without LoRA
            return
        info = GaugeMetricFamily(
            "pagedserve_lora_requests_info",
            "Running stats on LoRA requests: adapters of running and waiting requests, and --max-loras.",
            labels=["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        waiting, running = ",".join(sorted(stats.waiting)), ",".join(sorted(stats.running))
        info.add_metric([self._model_name, str(stats.max_loras), waiting, running], time.time())
        yield info
        requests = CounterMetricFamily(
            "pagedserve_lora_requests",
            "Requests taken per LoRA adapter (each adapter of a mix counts once).",
            labels=["model_name", "lora_name"],
        )
        for name, count in sorted(stats.requests.items()):
            requests.add_metric([self._model_name, name], count)
        yield requests
