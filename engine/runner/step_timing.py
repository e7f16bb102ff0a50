"""Timing decode-shaped steps at start-up: the step-cost model that speculation's drafts are weighed against.

rows      1, 2, 4, ... up to `max_rows`: decode queries at a short shared context (a throwaway cache)
time      the model's forward and the logits of every row (each verification row samples), the fastest
          of several runs after a warm-up (CUDA: synchronized)
"""

from __future__ import annotations

import itertools
import time

import torch

from engine.attention import AttentionBackend
from engine.attention.kv_cache import KVCache, KVCacheSpec
from engine.attention.step_metadata import shared_context_decode_metadata
from engine.models.llama import LlamaForCausalLM
from scheduler import StepCost

STEP_COST_MAX_ROWS = 64
"""Decode rows timed at start-up for speculation's step-cost model at most (beyond, its cost is extrapolated)."""
CONTEXT = 128
"""Tokens of context each timed query reads: decode steps at a typical length, where the products dominate."""
MIN_SECONDS_PER_SIZE = 0.05
MAX_RUNS_PER_SIZE = 50
"""A size is timed for at least this long (when its runs are quick), in at most this many runs."""


@torch.inference_mode()
def measure_step_cost(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    spec: KVCacheSpec,
    device: torch.device,
    max_rows: int,
    repeats: int = 2,
    lockstep: bool = False,
) -> StepCost:
    """Seconds of a decode step of 1, 2, 4, ... `max_rows` rows (at least 1 and 2) on this machine. `lockstep`:
    exactly `repeats` + 1 runs of each size, whatever they take (tensor parallelism: every rank runs the same
    forward passes, whose all-reduces pair up; rank 0 keeps its timings)."""
    sizes = [1]
    while sizes[-1] * 2 <= max(max_rows, 2):
        sizes.append(sizes[-1] * 2)
    scratch = KVCache(spec, -(-CONTEXT // spec.block_size), device)
    seconds = []
    for rows in sizes:
        step = shared_context_decode_metadata(rows, CONTEXT, spec.block_size, device)
        input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        positions = torch.full((rows,), CONTEXT - 1, dtype=torch.int64, device=device)
        best, spent, attempt = float("inf"), 0.0, 0
        # The first run warms the products' caches up (not counted); then the fastest of at least `repeats`,
        # and of more while they are quick: a shared machine's stray pause must not price a size.
        while attempt <= repeats or (not lockstep and spent < MIN_SECONDS_PER_SIZE and attempt <= MAX_RUNS_PER_SIZE):
            started = time.perf_counter()
            metadata = backend.build_metadata(step, spec)
            hidden = model.forward(input_ids, positions, scratch.layers, [metadata] * spec.num_layers, backend)
            model.compute_logits(hidden).argmax(dim=-1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - started
            if attempt:
                best = min(best, elapsed)
                spent += elapsed
            attempt += 1
        seconds.append(best)
    scratch.release()
    return step_cost_of(sizes, seconds)


def step_cost_of(sizes: list[int], seconds: list[float]) -> StepCost:
    """The model of timed sizes: a larger step never costs less (timing noise that says so would make rows
    look free)."""
    return StepCost(tuple(sizes), tuple(itertools.accumulate(seconds, max)))
