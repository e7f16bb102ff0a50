"""`pagedserve bench serve`: drive an OpenAI-compatible server with a dataset of prompts and report
TTFT, TPOT, ITL, E2E latency, throughput and goodput (metrics.py), like vLLM's `vllm bench serve`.

    pagedserve bench serve --base-url http://127.0.0.1:8000 --dataset random --input-len 128 \\
        --output-len 128 --num-prompts 64 --max-concurrency 16 --ignore-eos --result-json out.json

Requests start as a Poisson process at `--request-rate` (inf: all at once; `--burstiness` < 1 is
burstier, > 1 more regular: gamma-distributed gaps, as vLLM draws them), at most `--max-concurrency`
in flight. Prompts come from the served model's tokenizer (`--tokenizer`: a checkpoint directory,
a .gguf file or a hub id in the local cache; default `--model` when it is a local path, else the
embedded model's), so their token lengths are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence

import httpx

from server.benchmark.client import ENDPOINT_PATHS, Clock, RequestResult, Target, send
from server.benchmark.datasets import (
    BenchRequest,
    jsonl_requests,
    prefix_shared_requests,
    random_requests,
    sharegpt_requests,
)
from server.benchmark.acceptance import acceptance, spec_decode_counts
from server.benchmark.metrics import BenchmarkMetrics, compute, format_table, parse_slos

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadShape:
    request_rate: float = float("inf")  # requests/s
    burstiness: float = 1.0
    max_concurrency: Optional[int] = None
    seed: int = 0


def arrival_gaps(count: int, shape: LoadShape) -> list[float]:
    """Seconds to wait before each request: 0 at an infinite rate, else gamma(burstiness, 1 / (rate *
    burstiness)) gaps, whose mean is 1 / rate (burstiness 1: a Poisson process)."""
    if shape.request_rate == float("inf"):
        return [0.0] * count
    if shape.request_rate <= 0 or shape.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    rng = random.Random(shape.seed)
    theta = 1.0 / (shape.request_rate * shape.burstiness)
    return [rng.gammavariate(shape.burstiness, theta) for _ in range(count)]


async def run_load(
    target: Target,
    requests: Sequence[BenchRequest],
    shape: LoadShape,
    progress: bool = True,
    clock: Clock = time.perf_counter,
) -> tuple[list[RequestResult], float]:
    """Send every request by the load shape; the results (in request order) and the duration in seconds
    (both timed with `clock`)."""
    from tqdm.auto import tqdm

    limit = shape.max_concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    bar = tqdm(total=len(requests), disable=not progress, unit="req", file=sys.stderr)
    timeout = httpx.Timeout(6 * 3600.0, connect=30.0)
    async with httpx.AsyncClient(
        timeout=timeout, limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    ) as client:

        async def one(request: BenchRequest) -> RequestResult:
            async with semaphore:
                result = await send(client, target, request, clock)
            bar.update(1)
            return result

        started = clock()
        tasks = []
        for request, gap in zip(requests, arrival_gaps(len(requests), shape)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = clock() - started
    bar.close()
    return list(results), duration


def served_model(base_url: str, api_key: Optional[str]) -> str:
    """The first model the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def load_bench_tokenizer(tokenizer: Optional[str], model: Optional[str]):
    from engine.loading.loader import prepare_checkpoint
    from engine.text.tokenizer import load_tokenizer

    source = tokenizer
    if source is None and model is not None and Path(model).expanduser().exists():
        source = model
    if source is None:
        logger.info("prompts from the embedded model's tokenizer (give --tokenizer for another model)")
    return load_tokenizer(prepare_checkpoint(source).path)


def build_requests(args: argparse.Namespace, tokenizer) -> list[BenchRequest]:
    if args.dataset == "random":
        return random_requests(
            tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed
        )
    if args.dataset == "prefix-shared":
        return prefix_shared_requests(
            tokenizer, args.num_prompts, args.prefix_len, args.suffix_len, args.output_len, args.seed
        )
    if args.dataset_path is None:
        raise ValueError(f"--dataset {args.dataset} needs --dataset-path FILE")
    if args.dataset == "sharegpt":
        return sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len, args.seed)
    return jsonl_requests(args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len)


_ENDPOINT_PATHS = {path: name for name, path in ENDPOINT_PATHS.items()}  # vLLM's --endpoint values


def _endpoint(text: str) -> str:
    return _ENDPOINT_PATHS.get(text.rstrip("/"), text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve bench serve",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--base-url",
        default=None,
        help="the server (any OpenAI-compatible one); unset: http://HOST:PORT of --host and --port",
    )
    p.add_argument("--host", default="127.0.0.1", help="the server's address, as vLLM's bench takes it")
    p.add_argument("--port", type=int, default=8000, help="the server's port, as vLLM's bench takes it")
    p.add_argument("--model", default=None, help="model name to send; none: the first at /v1/models")
    p.add_argument(
        "--endpoint",
        type=_endpoint,
        choices=tuple(ENDPOINT_PATHS),
        default="completions",
        help="the API to load: /v1/completions, /v1/chat/completions with each prompt as one user message, or "
        "/v1/embeddings with each prompt as one input (a pooling model's; its requests generate nothing, their "
        "TTFT is their latency); vLLM's paths name them too",
    )
    p.add_argument(
        "--dataset",
        "--dataset-name",
        choices=("random", "prefix-shared", "sharegpt", "jsonl"),
        default="random",
        help="where the prompts come from: random tokens (--input-len, --output-len), one shared prefix "
        "with a suffix of its own each (--prefix-len, --suffix-len), or a file (--dataset-path: a "
        "ShareGPT JSON, or JSON lines with a prompt each)",
    )
    p.add_argument("--dataset-path", type=Path, default=None, help="file for --dataset sharegpt / jsonl")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer of the served model, to make prompts of exact token lengths: a checkpoint "
        "directory, a .gguf file or a hub id in the local cache (default: --model when it is a local "
        "path, else the embedded model's)",
    )
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (the run's size)")
    p.add_argument("--input-len", "--random-input-len", type=int, default=128, help="random: prompt tokens")
    p.add_argument(
        "--output-len", "--random-output-len", type=int, default=128, help="random, prefix-shared: max_tokens"
    )
    p.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in len * [1-r, 1+r]",
    )
    p.add_argument("--prefix-len", type=int, default=448, help="prefix-shared: tokens of the common prefix")
    p.add_argument("--suffix-len", type=int, default=64, help="prefix-shared: tokens of each own suffix")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="sharegpt, jsonl: override output lengths")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps between requests: 1 is Poisson, below 1 burstier, above more regular",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--ignore-eos", action="store_true", help="ask every request to run its max_tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the arrival times")
    p.add_argument(
        "--goodput",
        nargs="+",
        metavar="NAME:MS",
        default=None,
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000",
    )
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (or $OPENAI_API_KEY)")
    p.add_argument(
        "--result-json",
        type=Path,
        default=None,
        help="write the figures and per-request data here (python -m benchmarks.report reads it)",
    )
    p.add_argument("--label", default=None, help="a name for this run in the JSON")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def benchmark(args: argparse.Namespace) -> tuple[BenchmarkMetrics, dict]:
    """Run the benchmark the arguments describe; its metrics and the JSON record."""
    slos = parse_slos(args.goodput)
    model = args.model or served_model(args.base_url, args.api_key)
    tokenizer = load_bench_tokenizer(args.tokenizer, args.model)
    requests = build_requests(args, tokenizer)
    target = Target(args.base_url, model, args.endpoint, args.ignore_eos, args.api_key, args.temperature)
    shape = LoadShape(args.request_rate, args.burstiness, args.max_concurrency, args.seed)
    probe, _ = asyncio.run(run_load(target, requests[:1], LoadShape(), progress=False))
    if not probe[0].success:
        raise RuntimeError(f"the first request failed, nothing measured: {probe[0].error}")
    counts_before = spec_decode_counts(args.base_url, args.api_key)
    results, duration = asyncio.run(run_load(target, requests, shape, progress=not args.disable_tqdm))
    metrics = compute(results, duration, slos)
    speculation = acceptance(counts_before, spec_decode_counts(args.base_url, args.api_key))
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "label": args.label,
        "base_url": args.base_url,
        "model": model,
        "endpoint": args.endpoint,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "goodput_slos_ms": slos or None,
        "client_host": {"machine": platform.machine(), "python": platform.python_version()},
        **metrics.to_dict(),
        "speculative_decoding": speculation,
        "input_lens": [r.prompt_len for r in results],
        "max_tokens": [r.output_len for r in requests],
        "output_lens": [r.output_tokens for r in results],
        "ttfts_s": [r.ttft for r in results],
        "itls_s": [r.itl for r in results],
        "latencies_s": [r.latency for r in results],
        "errors_per_request": [r.error for r in results],
    }
    return metrics, record


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The arguments, vLLM's spellings taken: `--host` / `--port` make the base URL unless `--base-url` is
    given; `--dataset-name`, `--random-input-len`, `--random-output-len`, `--random-range-ratio` and an
    `--endpoint` path are the same options as `--dataset`, `--input-len`, ... and `--endpoint completions`."""
    args = build_parser().parse_args(argv)
    if args.base_url is None:
        host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address
        args.base_url = f"http://{host}:{args.port}"
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # else a line per request, across the progress bar
    try:
        metrics, record = benchmark(args)
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:
        print(f"pagedserve bench serve: {exc}", file=sys.stderr)
        return 1
    print(format_table(metrics))
    if record["speculative_decoding"] is not None:
        spec = record["speculative_decoding"]
        print(
            f"Speculative decoding: mean acceptance length {spec['mean_acceptance_length']:.2f} tokens per drafted "
            f"step, {100 * spec['acceptance_rate']:.0f}% of draft tokens accepted"
        )
    if args.result_json is not None:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(record, indent=1))
    return 0 if metrics.completed else 1


if __name__ == "__main__":
    sys.exit(main())
