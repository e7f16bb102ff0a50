"""Prometheus metrics (label `model_name`), in a registry of the app's own.

Per-request counters and histograms are updated from the engine's outputs on the
event loop; queue lengths, KV usage, preemptions and prefix-cache counters are
read from the scheduler at scrape time, so they are exact and never drift (the speculative-decoding
counters among them: the scheduler tallies each verification as it rolls the rejected drafts back). GPU
readings come from the `GpuMonitor`'s latest round (its thread calls NVML, a scrape
never does), and exist only while a monitor runs: none on CPU.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.observer import EngineObserver
from engine.outputs import RequestOutput
from scheduler import KVTierStats, SchedulerStats, SpecDecodeStats
from server.observability.gpu_monitor import GpuMonitor, GpuSample

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class _SchedulerCollector(Collector):
    """Gauges and cumulative counters straight from `SchedulerStats` at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats]):
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterable:
        stats = self._stats()
        labels = [self._model_name]
        for name, doc, value in (
            ("pagedserve_num_requests_running", "Requests in the running batch.", stats.num_running),
            (
                "pagedserve_num_requests_waiting",
                "Requests waiting to be scheduled (incl. preempted).",
                stats.num_waiting,
            ),
            ("pagedserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0 to 1).", stats.kv_cache_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(labels, value)
            yield gauge
        for name, doc, value in (
            ("pagedserve_num_preemptions", "Requests preempted for lack of KV blocks.", stats.num_preemptions),
            ("pagedserve_prefix_cache_queries", "Tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("pagedserve_prefix_cache_hits", "Tokens found in the prefix cache.", stats.prefix_cache_hits),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter
        if stats.speculation is not None:
            yield from self._speculation(stats.speculation)
        if stats.kv_tiers:
            yield from self._kv_tiers(stats.kv_tiers)

    def _kv_tiers(self, tiers: tuple[KVTierStats, ...]) -> Iterable:
        """The KV tiers' counters (label `tier`: memory, disk), beside the prefix cache's (only with a tier)."""
        for name, doc, field in (
            ("pagedserve_kv_tier_hit_blocks", "KV blocks restored from the tier instead of computed.", "hit_blocks"),
            (
                "pagedserve_kv_tier_hit_tokens",
                "Prompt tokens restored from the tier instead of computed.",
                "hit_tokens",
            ),
            ("pagedserve_kv_tier_read_bytes", "Bytes of KV blocks read back from the tier.", "read_bytes"),
            ("pagedserve_kv_tier_written_bytes", "Bytes of KV blocks written to the tier.", "written_bytes"),
            (
                "pagedserve_kv_tier_corrupt_files",
                "Block files found corrupt, truncated or of another key: deleted, the block computed.",
                "corrupt_files",
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name", "tier"])
            for tier in tiers:
                counter.add_metric([self._model_name, tier.tier], getattr(tier, field))
            yield counter

    def _speculation(self, spec: SpecDecodeStats) -> Iterable:
        """vLLM's speculative-decoding counters, with our prefix (only when the engine speculates)."""
        labels = [self._model_name]
        for name, doc, value in (
            ("pagedserve_spec_decode_num_drafts", "Steps in which a request verified draft tokens.", spec.num_drafts),
            ("pagedserve_spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", spec.num_draft_tokens),
            ("pagedserve_spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter
        per_pos = CounterMetricFamily(
            "pagedserve_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft (0 first).",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric([self._model_name, str(position)], value)
        yield per_pos


class _GpuCollector(Collector):
    """Gauges (labels `model_name`, `gpu`) from the GPU monitor's latest readings; nothing without them."""

    def __init__(self, model_name: str, samples: Callable[[], Sequence[GpuSample]]):
        self._model_name = model_name
        self._samples = samples

    def collect(self) -> Iterable:
        samples = self._samples()
        for name, doc, read in (
            (
                "pagedserve_gpu_utilization_ratio",
                "Fraction of the last NVML sample period a kernel ran on the GPU.",
                lambda sample: sample.utilization,
            ),
            (
                "pagedserve_gpu_memory_used_bytes",
                "GPU memory in use, by every process (NVML).",
                lambda sample: sample.memory_used,
            ),
            ("pagedserve_gpu_memory_total_bytes", "GPU memory in all (NVML).", lambda sample: sample.memory_total),
        ):
            values = [(sample.gpu, read(sample)) for sample in samples if read(sample) is not None]
            if values:
                gauge = GaugeMetricFamily(name, doc, labels=["model_name", "gpu"])
                for gpu, value in values:
                    gauge.add_metric([self._model_name, gpu], value)
                yield gauge


_GRAMMAR_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


# the label values a request's end can take: an engine finish (stop string or token, max_tokens or the context),
# or a failure (the client went, a 400, --request-timeout, an error in the engine)
FINISHED_REASONS = ("stop", "length")
FAILURE_REASONS = ("aborted", "rejected", "timeout", "error")


class ServerMetrics(EngineObserver):
    """Everything `/metrics` shows; one instance per app."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats], cache_info: dict[str, str]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens", "Generated tokens of finished requests.", m, registry=r
        )
        self.request_success = Counter(
            "pagedserve_request_success",
            "Requests that finished, by finish reason.",
            m + ["finished_reason"],
            registry=r,
        )
        self.request_failure = Counter(
            "pagedserve_request_failure",
            "Requests that failed: aborted (client gone), rejected (400), timeout (--request-timeout), error.",
            m + ["reason"],
            registry=r,
        )
        self.request_rejected = Counter(
            "pagedserve_request_rejected",
            "Requests refused before any work: queue_full (429).",
            m + ["reason"],
            registry=r,
        )
        self.counting_requests = False  # outputs count from the end of the warm-up (not a client's request)
        self.http_requests = Counter(
            "pagedserve_http_requests", "HTTP responses by route and status.", m + ["route", "status"], registry=r
        )

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, m, buckets=_LATENCY_BUCKETS, registry=r)

        def tokens(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, m, buckets=_TOKEN_BUCKETS, registry=r)

        self.ttft = latency("pagedserve_time_to_first_token_seconds", "Arrival to first generated token.")
        self.itl = latency("pagedserve_inter_token_latency_seconds", "Time between consecutive output steps.")
        self._itl_child = self.itl.labels(model_name)  # observed on every token: the label lookup done once
        self.tpot = latency("pagedserve_time_per_output_token_seconds", "Mean time per token after the first.")
        self.e2e = latency("pagedserve_e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = latency("pagedserve_request_queue_time_seconds", "Arrival to first scheduled.")
        self.request_prompt_tokens = tokens("pagedserve_request_prompt_tokens", "Prompt tokens per request.")
        self.request_generation_tokens = tokens("pagedserve_request_generation_tokens", "Generated tokens per request.")
        self.iteration_tokens = tokens("pagedserve_iteration_tokens", "Tokens computed per engine step.")
        self.grammar_compile = Histogram(
            "pagedserve_grammar_compile_seconds",
            "Compiling a structured-output grammar (cache misses only).",
            m,
            buckets=_GRAMMAR_BUCKETS,
            registry=r,
        )
        self.grammar_mask_fill = Histogram(
            "pagedserve_grammar_mask_fill_seconds",
            "Filling a step's token bitmask of its constrained requests.",
            m,
            buckets=_GRAMMAR_BUCKETS,
            registry=r,
        )
        self.model_weight_bytes = Gauge(
            "pagedserve_model_weight_bytes",
            "Memory the model's weights take (quantized ones by their blocks and scales).",
            m + ["quantization"],
            registry=r,
        )
        Info("pagedserve_cache_config", "KV cache configuration.", registry=r).info(
            {"model_name": model_name, **cache_info}
        )
        self._zero_series()
        self.registry.register(_SchedulerCollector(model_name, stats))
        self.gpu_monitor: Optional[GpuMonitor] = None  # set by the app's lifespan where the engine is on CUDA
        self.registry.register(_GpuCollector(model_name, self._gpu_samples))

    def _zero_series(self) -> None:
        """Every series whose labels are known before any request, at 0 (as vLLM's are): an idle replica's
        rate() and increase() read 0, not "no data" (a series first seen at 1 also loses that first increment)."""
        name = self.model_name
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.tpot,
            self.e2e,
            self.queue_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.iteration_tokens,
            self.grammar_compile,
            self.grammar_mask_fill,
        ):
            metric.labels(name)
        for finished_reason in FINISHED_REASONS:
            self.request_success.labels(name, finished_reason)
        for reason in FAILURE_REASONS:
            self.request_failure.labels(name, reason)
        self.request_rejected.labels(name, "queue_full")

    def _gpu_samples(self) -> Sequence[GpuSample]:
        monitor = self.gpu_monitor
        return () if monitor is None else monitor.samples

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_output(self, output: RequestOutput) -> None:
        """Called on the event loop for every RequestOutput, in order."""
        if not self.counting_requests:
            return
        name = self.model_name
        itl = output.metrics.inter_token_latency
        if output.new_token_ids and itl is not None:
            self._itl_child.observe(itl)
        if not output.finished:
            return
        if output.finish_reason == "abort":
            self.request_failure.labels(name, output.abort_reason or "aborted").inc()
        elif output.error is not None:  # failed alone in the engine (see engine.runner.fault_isolation)
            self.request_failure.labels(name, "error").inc()
        else:
            self.request_success.labels(name, output.finish_reason).inc()
        self.prompt_tokens.labels(name).inc(output.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(output.num_output_tokens)
        self.request_prompt_tokens.labels(name).observe(output.num_prompt_tokens)
        self.request_generation_tokens.labels(name).observe(output.num_output_tokens)
        self._observe_latencies(output)

    def _observe_latencies(self, output: RequestOutput) -> None:
        name, metrics = self.model_name, output.metrics
        if metrics.time_to_first_token is not None:
            self.ttft.labels(name).observe(metrics.time_to_first_token)
        if metrics.queue_time is not None:
            self.queue_time.labels(name).observe(metrics.queue_time)
        if metrics.e2e_latency is not None:
            self.e2e.labels(name).observe(metrics.e2e_latency)
        if (
            output.num_output_tokens > 1
            and metrics.first_token_time is not None
            and metrics.last_token_time is not None
        ):
            span = metrics.last_token_time - metrics.first_token_time
            self.tpot.labels(name).observe(span / (output.num_output_tokens - 1))

    def observe_failure(self, reason: str) -> None:
        """A request that ended before the engine served it: "rejected" (400) or "error"."""
        self.request_failure.labels(self.model_name, reason).inc()

    def observe_rejected(self, reason: str = "queue_full") -> None:
        self.request_rejected.labels(self.model_name, reason).inc()

    def on_step(self, num_tokens: int) -> None:
        """Called on the engine thread after each step (prometheus-client is thread-safe)."""
        self.iteration_tokens.labels(self.model_name).observe(num_tokens)

    def on_grammar_compile(self, seconds: float) -> None:
        self.grammar_compile.labels(self.model_name).observe(seconds)

    def on_grammar_fill(self, seconds: float) -> None:
        self.grammar_mask_fill.labels(self.model_name).observe(seconds)

    def observe_http(self, route: str, status: int) -> None:
        self.http_requests.labels(self.model_name, route, str(status)).inc()


def cache_info(
    num_blocks: int,
    block_size: int,
    enable_prefix_caching: bool,
    dtype: str,
    attention_backend: str,
    max_model_len: int,
    cuda_graphs: str = "off",
) -> dict:
    return {
        "num_blocks": str(num_blocks),
        "block_size": str(block_size),
        "num_tokens": str(num_blocks * block_size),
        "enable_prefix_caching": str(enable_prefix_caching).lower(),
        "cache_dtype": dtype,
        "attention_backend": attention_backend,
        "cuda_graphs": cuda_graphs,
        "max_model_len": str(max_model_len),
    }
