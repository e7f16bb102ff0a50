"""The workloads every server runs, and their prompts.

Every prompt ends in a counting task ("... Now count upward from 212: 212, 213, ... 217,"), which keeps the
embedded model generating up to max_tokens at temperature 0 on its own: `transformers serve` refuses
`ignore_eos`, so this is what makes its requests as long as the others'. The servers that take `ignore_eos`
get it as well; every run records the output lengths each server actually produced (from `usage`).

    prompt = random tokens (own, or a shared prefix + own) + counting tail, exactly `input_len` tokens
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Optional

from engine.text.tokenizer import Tokenizer
from server.benchmark.datasets import BenchRequest, _ordinary_ids, text_of_length


@dataclass(frozen=True, slots=True)
class Workload:
    name: str  # short key: c1, c16, c64, prefix, poisson
    title: str  # what the table says
    num_prompts: int
    input_len: int
    output_len: int
    max_concurrency: Optional[int] = None  # None: no cap
    prefix_len: int = 0  # > 0: every prompt starts with the same prefix of this many tokens
    request_rate: float = float("inf")  # req/s; finite: Poisson arrivals (set once measured, see peers.py)
    goodput: bool = False  # report goodput against the run's SLOs

    @property
    def slots(self) -> int:
        """Requests in flight at most: what a server with fixed slots (llama.cpp) is started with."""
        return self.max_concurrency or 64


def workloads(quick: bool = False) -> list[Workload]:
    """The issue's workloads; `quick` shrinks them to check the plumbing (same shapes, fewer and shorter)."""
    if quick:
        return [
            Workload("c1", "concurrency 1, 128 in / 16 out", 2, 128, 16, max_concurrency=1),
            Workload("c16", "concurrency 16, 128 in / 16 out", 16, 128, 16, max_concurrency=16),
            Workload("c64", "concurrency 64, 128 in / 8 out", 64, 128, 8, max_concurrency=64),
            Workload(
                "prefix",
                "prefix-shared 512 in (448 shared) / 8 out, concurrency 16",
                16,
                512,
                8,
                max_concurrency=16,
                prefix_len=448,
            ),
            Workload("poisson", "Poisson arrivals, 128 in / 16 out", 16, 128, 16, goodput=True),
        ]
    return [
        Workload("c1", "concurrency 1, 128 in / 128 out", 4, 128, 128, max_concurrency=1),
        Workload("c16", "concurrency 16, 128 in / 128 out", 32, 128, 128, max_concurrency=16),
        Workload("c64", "concurrency 64, 128 in / 128 out", 64, 128, 128, max_concurrency=64),
        Workload(
            "prefix",
            "prefix-shared 512 in (448 shared) / 64 out, concurrency 16",
            32,
            512,
            64,
            max_concurrency=16,
            prefix_len=448,
        ),
        Workload("poisson", "Poisson arrivals, 128 in / 128 out", 32, 128, 128, goodput=True),
    ]


def with_rate(workload: Workload, rate: float) -> Workload:
    return replace(workload, request_rate=rate)


def counting_tail(rng: random.Random) -> str:
    start = rng.randint(10, 600)
    return f"\nNow count upward from {start}: " + ", ".join(str(start + i) for i in range(6)) + ","


def _exact(
    tokenizer: Tokenizer, head: str, body_len: int, tail: str, length: int, pool: list[int], rng: random.Random
) -> tuple[str, int]:
    """head + random body + tail, the body's length adjusted until the whole encodes to `length` tokens
    (tokens can merge across the joins); the text and its length (the closest found if never exact)."""
    best = None
    for _ in range(12):
        body, _ = text_of_length(
            tokenizer, [rng.choice(pool) for _ in range(max(1, body_len))], max(1, body_len), pool, rng
        )
        text = head + body + tail
        actual = len(tokenizer.encode(text, add_special_tokens=False))
        if actual == length:
            return text, actual
        if best is None or abs(actual - length) < abs(best[1] - length):
            best = (text, actual)
        body_len += length - actual
    return best


def build_requests(tokenizer: Tokenizer, workload: Workload, seed: int = 0) -> list[BenchRequest]:
    """The workload's prompts: the same for every server and round (seeded)."""
    rng = random.Random(seed)
    pool = _ordinary_ids(tokenizer)
    prefix = ""
    if workload.prefix_len:
        prefix, _ = text_of_length(
            tokenizer, [rng.choice(pool) for _ in range(workload.prefix_len)], workload.prefix_len, pool, rng
        )
        prefix += "\n"
    prefix_tokens = len(tokenizer.encode(prefix, add_special_tokens=False)) if prefix else 0
    requests = []
    for _ in range(workload.num_prompts):
        tail = counting_tail(rng)
        tail_len = len(tokenizer.encode(tail, add_special_tokens=False))
        body_len = workload.input_len - prefix_tokens - tail_len
        text, actual = _exact(tokenizer, prefix, body_len, tail, workload.input_len, pool, rng)
        requests.append(BenchRequest(text, actual, workload.output_len))
    return requests


def stop_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids that end a generation: the tokenizer's EOS and the usual end-of-turn / end-of-text tokens."""
    hf = tokenizer.hf
    ids = {hf.eos_token_id} if hf.eos_token_id is not None else set()
    vocab = hf.get_vocab()
    for name in ("<|endoftext|>", "<|im_end|>", "</s>", "<|eot_id|>", "<|end_of_text|>"):
        if name in vocab:
            ids.add(vocab[name])
    return sorted(ids)
