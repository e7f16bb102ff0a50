"""Embedding throughput against llama.cpp's server on the same GGUF (the embedded SmolLM2-135M-Instruct Q4_1),
both pooling the last token and normalizing:

    python -m benchmarks.embeddings [--rounds 3] [--inputs 64] [--lengths 128,512] [--batch 8] [--concurrency 2]
        [--pagedserve-args "--quantization gguf"]

Each server is started once (pagedserve with --runner pooling, llama.cpp with --embedding last and as many slots
as inputs in flight), warmed up, then the servers take turns, round by round: every round sends fresh random texts
of exactly each length (the same texts to both servers, so neither serves a text it saw before from a cache),
`batch` inputs per request, `concurrency` requests in flight. It prints the CPU, each run's inputs/s and tokens/s,
the median ratio per length, and how alike the two servers' vectors are for the same text (cosine: both read the
same weights, so they should agree up to their arithmetic). Run it alone: on 2 cores any other busy process
skews both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import statistics
import sys
import time
from typing import Optional, Sequence

import httpx
import numpy as np

from benchmarks.machine import cpu_line
from benchmarks.plot_runner import WORK_DIR
from benchmarks.servers import LLAMACPP_VENV, MODEL_NAME, ServerPool, ensure_venv, llamacpp_peer, pagedserve_peer
from engine.loading.loader import embedded_gguf_path
from server.benchmark.datasets import _ordinary_ids, text_of_length


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=64, help="texts per length and round")
    parser.add_argument("--lengths", default="128,512", help="tokens per text, comma-separated")
    parser.add_argument("--batch", type=int, default=8, help="texts per request (`input` as a list)")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--pagedserve-args", default="", help="more flags for pagedserve serve")
    return parser


def texts_for(tokenizer, pool: list[int], length: int, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        text_of_length(tokenizer, [rng.choice(pool) for _ in range(length)], length, pool, rng)[0] for _ in range(count)
    ]


async def embed_all(base_url: str, texts: list[str], batch: int, concurrency: int) -> tuple[float, int, list]:
    """Seconds to embed every text (`batch` per request, `concurrency` requests in flight), prompt tokens the
    server counted, and the vectors in order."""
    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    vectors: list = [None] * len(chunks)
    tokens = 0
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, index: int) -> None:
        nonlocal tokens
        async with gate:
            body = {"model": MODEL_NAME, "input": chunks[index], "encoding_format": "float"}
            response = await client.post(f"{base_url}/v1/embeddings", json=body)
            response.raise_for_status()
            answer = response.json()
            vectors[index] = [d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])]
            tokens += answer["usage"]["prompt_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(len(chunks))))
        seconds = time.perf_counter() - started
    return seconds, tokens, [v for chunk in vectors for v in chunk]


def cosines(a: list, b: list) -> list[float]:
    out = []
    for x, y in zip(a, b):
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        out.append(float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.loading.loader import prepare_checkpoint
    from engine.text.tokenizer import load_tokenizer

    lengths = [int(n) for n in args.lengths.split(",")]
    print(cpu_line(), flush=True)
    tokenizer = load_tokenizer(prepare_checkpoint(None).path)
    pool = _ordinary_ids(tokenizer)
    logs = WORK_DIR / "embeddings-logs"
    logs.mkdir(parents=True, exist_ok=True)
    python = ensure_venv(WORK_DIR / "venvs", LLAMACPP_VENV, logs / "pip-llamacpp.log")
    slots = args.batch * args.concurrency
    peers = [
        pagedserve_peer("pagedserve", ["--runner", "pooling", *shlex.split(args.pagedserve_args)]),
        # (each slot holds the longest input whole: llama.cpp embeds an input in one batch)
        llamacpp_peer(
            python,
            embedded_gguf_path(),
            args.threads,
            [],
            ["--ctx-per-slot", str(max(lengths) + 64), "--embedding", "last"],
        ),
    ]
    print(
        f"{args.inputs} texts per length and round, {args.batch} per request, {args.concurrency} requests in flight; "
        f"pagedserve {' '.join(['--runner pooling', args.pagedserve_args]).strip()}; llama.cpp --embedding last, "
        f"{slots} slots, {args.threads} threads",
        flush=True,
    )
    rates: dict[tuple[str, int], list[float]] = {}
    with ServerPool(logs) as servers:
        for peer in peers:  # started (and warmed) one at a time, then both kept: the rounds alternate
            server = servers.get(peer, slots)
            asyncio.run(embed_all(server.base_url, texts_for(tokenizer, pool, 32, 4, seed=-1), 4, 1))
        for round_no in range(args.rounds):
            for length in lengths:
                texts = texts_for(tokenizer, pool, length, args.inputs, seed=round_no * 1000 + length)
                results = {}
                order = peers if round_no % 2 == 0 else peers[::-1]
                for peer in order:
                    server = servers.get(peer, slots)
                    seconds, tokens, vectors = asyncio.run(
                        embed_all(server.base_url, texts, args.batch, args.concurrency)
                    )
                    results[peer.name] = vectors
                    rate = len(texts) / seconds
                    rates.setdefault((peer.name, length), []).append(rate)
                    print(
                        f"round {round_no + 1} {length:>5} tokens {peer.name:>10}: {rate:7.2f} inputs/s "
                        f"{tokens / seconds:9.0f} tokens/s ({tokens} tokens, {seconds:.2f} s)",
                        flush=True,
                    )
                alike = cosines(results["pagedserve"], results["llama.cpp"])
                print(
                    f"    cosine pagedserve vs llama.cpp: min {min(alike):.4f}, median {statistics.median(alike):.4f}"
                )
    for length in lengths:
        ours = statistics.median(rates[("pagedserve", length)])
        theirs = statistics.median(rates[("llama.cpp", length)])
        print(
            f"{length} tokens: pagedserve {ours:.2f} inputs/s, llama.cpp {theirs:.2f} inputs/s: "
            f"{ours / theirs:.2f}x (median of {args.rounds} rounds)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
