"""The benchmark's figures from its timed requests, with vLLM's `bench serve` definitions:

    TTFT        send -> first content chunk                                  per request
    TPOT        (E2E latency - TTFT) / (output tokens - 1)                    per request with > 1 token
    ITL         every gap between consecutive content chunks                  all requests pooled
    E2EL        send -> end of stream                                         per request
    throughput  completed requests, output tokens, input + output tokens     / benchmark duration
    goodput     requests meeting every given SLO (TTFT, TPOT, E2EL in ms)     / benchmark duration

Each latency as mean, median, p90 and p99 (numpy's linear percentiles), in milliseconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np

from server.benchmark.client import RequestResult

PERCENTILES = (50, 90, 99)
SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, slots=True)
class Distribution:
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values_s: Sequence[float]) -> "Distribution":
        """Of values in seconds, reported in milliseconds (zeros when there are none)."""
        if not len(values_s):
            return cls(0.0, 0.0, 0.0, 0.0)
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        median, p90, p99 = np.percentile(ms, PERCENTILES)
        return cls(float(ms.mean()), float(median), float(p90), float(p99))


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # tok/s
    request_goodput: Optional[float]  # req/s meeting every SLO; None without SLOs
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    errors: dict[str, int] = field(default_factory=dict)  # first words of each error -> count

    def to_dict(self) -> dict:
        return asdict(self)


def tpot(result: RequestResult) -> Optional[float]:
    """Seconds per output token after the first (None for a request with fewer than 2 tokens)."""
    if result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def meets(result: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    """Whether a successful request meets every SLO given (ms): ttft, tpot, e2el."""
    values = {"ttft": result.ttft, "tpot": tpot(result) or 0.0, "e2el": result.latency}
    return all(values[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def compute(
    results: Sequence[RequestResult], duration_s: float, slos_ms: Optional[Mapping[str, float]] = None
) -> BenchmarkMetrics:
    ok = [r for r in results if r.success]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            key = r.error.split(":")[0][:60] or "unknown"
            errors[key] = errors.get(key, 0) + 1
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in map(tpot, ok) if t is not None]
    goodput = None
    if slos_ms:
        goodput = sum(meets(r, slos_ms) for r in ok) / duration_s
    return BenchmarkMetrics(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        request_goodput=goodput,
        ttft_ms=Distribution.of([r.ttft for r in ok]),
        tpot_ms=Distribution.of(tpots),
        itl_ms=Distribution.of([gap for r in ok for gap in r.itl]),
        e2el_ms=Distribution.of([r.latency for r in ok]),
        errors=errors,
    )


def parse_slos(items: Optional[Sequence[str]]) -> dict[str, float]:
    """`ttft:500 tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items or ():
        name, _, value = item.partition(":")
        if name not in SLO_NAMES or not value:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {', '.join(SLO_NAMES)}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the limit must be positive")
    return slos


def format_table(metrics: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """The human-readable summary printed at the end of a run."""
    rows = [
        ("Successful requests", f"{metrics.completed}"),
        ("Failed requests", f"{metrics.failed}"),
        ("Benchmark duration (s)", f"{metrics.duration_s:.2f}"),
        ("Total input tokens", f"{metrics.total_input_tokens}"),
        ("Total generated tokens", f"{metrics.total_output_tokens}"),
        ("Request throughput (req/s)", f"{metrics.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{metrics.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{metrics.total_token_throughput:.2f}"),
    ]
    if metrics.request_goodput is not None:
        rows.append(("Request goodput (req/s)", f"{metrics.request_goodput:.2f}"))
    lines = [f"{'=' * 22} {title} {'=' * 22}"]
    width = len(lines[0])
    lines += [f"{name:<40}{value:>{width - 40}}" for name, value in rows]
    for label, dist in (
        ("Time to First Token", metrics.ttft_ms),
        ("Time per Output Token (excl. 1st token)", metrics.tpot_ms),
        ("Inter-token Latency", metrics.itl_ms),
        ("End-to-end Latency", metrics.e2el_ms),
    ):
        lines.append(f"{label:-^{width}}")
        short = {"Time to First Token": "TTFT", "Inter-token Latency": "ITL", "End-to-end Latency": "E2EL"}.get(
            label, "TPOT"
        )
        for stat in ("mean", "median", "p90", "p99"):
            name = f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {short} (ms)"
            lines.append(f"{name:<40}{getattr(dist, stat):>{width - 40}.2f}")
    if metrics.errors:
        lines.append(f"{'Errors':-^{width}}")
        lines += [f"{name:<40}{count:>{width - 40}}" for name, count in sorted(metrics.errors.items())]
    lines.append("=" * width)
    return "\n".join(lines)
