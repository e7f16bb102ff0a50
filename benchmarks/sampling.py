"""The sampler on CPU: sampled rows drawn by the native kernel (csrc/sample_rows.cpp, what a CPU engine uses), and
logit_bias and the penalties applied by csrc/logit_processors.cpp, against the torch way (engine/sampling/sampler.py's
operations), per sampling setting, in microseconds per call; then a prompt's logprobs (`prompt_logprobs`,
`--prompt-rows` positions, 5 alternatives) both ways.

    python -m benchmarks.sampling [--vocab 49152,151936] [--rows 1,16] [--rounds 200] [--prompt-rows 1000]

Each case is a batch of `rows` rows of random logits (scale 3, or 1 for a flat distribution whose top-p nucleus
holds thousands of tokens) under one setting, each row with a history of HISTORY prompt and output ids (what
the penalties look at); the two samplers are called in turn, `--rounds` times, and each reports its median. Run
it alone: on 2 cores any other busy process changes the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.machine import cpu_line

# (label, sampling parameters, logits scale)
CASES = (
    ("temperature 0.7", {"temperature": 0.7}, 3.0),
    ("temperature 0.7, top-p 0.9", {"temperature": 0.7, "top_p": 0.9}, 3.0),
    ("temperature 1.0, top-p 0.95, flat", {"temperature": 1.0, "top_p": 0.95}, 1.0),
    ("temperature 0.8, top-k 40", {"temperature": 0.8, "top_k": 40}, 3.0),
    ("temperature 1.0, top-k 50, top-p 0.95", {"temperature": 1.0, "top_k": 50, "top_p": 0.95}, 3.0),
    ("temperature 1.0, min-p 0.05", {"temperature": 1.0, "min_p": 0.05}, 3.0),
    ("greedy, repetition penalty 1.1", {"temperature": 0.0, "repetition_penalty": 1.1}, 3.0),
    (
        "greedy, presence 0.3, frequency 0.5",
        {"temperature": 0.0, "presence_penalty": 0.3, "frequency_penalty": 0.5},
        3.0,
    ),
    ("temperature 0.7, top-p 0.9, repetition 1.1", {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}, 3.0),
    ("greedy, logit_bias of 8 tokens", {"temperature": 0.0, "logit_bias": {7 * i + 3: 2.0 for i in range(8)}}, 3.0),
)
HISTORY = (200, 300)
"""Prompt and output ids of each row (random, repeating): what the penalties look at."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="49152,151936", help="comma-separated vocabulary sizes")
    parser.add_argument("--rows", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--prompt-rows", type=int, default=1000, help="prompt positions scored for logprobs")
    args = parser.parse_args()
    from engine.kernels.cpu import load_cpu_kernels
    from engine.sampling.params import SamplingParams
    from engine.sampling.sampler import Sampler, prompt_logprobs
    from engine.sampling.state import SamplingState

    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the native kernels did not build here")
    print(cpu_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    native_sampler = Sampler(native_rows=kernels.sample_rows, native_processors=kernels.logit_processors)
    samplers = {"native": native_sampler, "torch": Sampler()}
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            for label, params, scale in CASES:
                logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * scale
                ids = torch.randint(0, vocab, (rows, sum(HISTORY)), generator=torch.Generator().manual_seed(3)).tolist()
                states = [
                    SamplingState.create(
                        SamplingParams(**params), row[: HISTORY[0]], row[HISTORY[0] :], frozenset(), torch.device("cpu")
                    )
                    for row in ids
                ]
                times: dict[str, list[float]] = {name: [] for name in samplers}
                for _ in range(args.rounds):
                    for name, sampler in samplers.items():
                        start = time.perf_counter()
                        sampler(logits, states)
                        times[name].append(time.perf_counter() - start)
                native, plain = (statistics.median(times[name]) for name in ("native", "torch"))
                print(
                    f"vocab {vocab}, {rows} row(s), {label}: native {native * 1e6:.0f} us, torch {plain * 1e6:.0f} us,"
                    f" native / torch {native / plain:.3f}"
                )
        logits = torch.randn(args.prompt_rows, vocab, generator=torch.Generator().manual_seed(1)) * 3
        targets = torch.randint(0, vocab, (args.prompt_rows,), generator=torch.Generator().manual_seed(2))
        scored: dict[str, list[float]] = {"native": [], "torch": []}
        for _ in range(5):
            for name, native_logprobs in (("native", kernels.row_logprobs), ("torch", None)):
                start = time.perf_counter()
                prompt_logprobs(logits, targets, 5, native_logprobs)
                scored[name].append(time.perf_counter() - start)
        native, plain = (statistics.median(scored[name]) for name in ("native", "torch"))
        print(
            f"vocab {vocab}, prompt logprobs of {args.prompt_rows} positions: native {native * 1e3:.1f} ms,"
            f" torch {plain * 1e3:.1f} ms, native / torch {native / plain:.3f}"
        )


if __name__ == "__main__":
    main()
