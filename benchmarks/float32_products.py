"""Float32 products on CPU: the column-block product against oneDNN's packed weights (and the plain-layout
small-batch product up to 16 rows), then whole decode steps of the embedded model on each.

    python -m benchmarks.float32_products [--rows 1,2,4,8,16,32,64,256,2048] [--rounds 9]
                                          [--steps-batches 1,4,16,64] [--steps 40]

Products: the four matrices of a layer of the embedded model (qkv 960 x 576, o 576 x 576, gate|up 3072 x 576,
down 576 x 1536), 30 layers of random weights each (424 MB: read from memory, as a decode step reads them), x in
float32, all the process's threads; rounds of the products alternated, the median per product and the median of
the per-round ratios. Steps: the embedded model dequantized (`--quantization none`, float32, max_num_seqs 256 as
a server's default engine), one engine per product in one process, `batch` sequences of 200-token prompts in
decode, steps alternated between them: the engine's own choice (column blocks on AVX2 and AVX-512 builds, its
decode steps fused) against `cpu_linear` declined (oneDNN's packed weights, unfused). Run it alone: on 2 cores any
other busy process changes the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from benchmarks.machine import cpu_line

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in): qkv, o, gate|up, down
LAYERS = 30


def _products(rows_list: list[int], rounds: int) -> None:
    from engine.kernels.column_block_weight import pack_invariant_weight
    from engine.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the native CPU kernels did not build")
    tiles = "vector tiles (AVX2 or AVX-512)" if kernels.f32_column_blocks else "no vector float32 tiles in this build"
    print(f"column blocks: {tiles}")
    generator = torch.Generator().manual_seed(0)
    plain = [[torch.randn(n, k, generator=generator) * k**-0.5 for n, k in SHAPES] for _ in range(LAYERS)]
    packed = [[pack_invariant_weight(w) for w in layer] for layer in plain]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in layer] for layer in plain]
    macs_per_row = LAYERS * sum(n * k for n, k in SHAPES)
    for rows in rows_list:
        x = {k: torch.randn(rows, k, generator=generator) for k in {k for _, k in SHAPES}}

        def column_blocks() -> None:
            for layer in packed:
                for w in layer:
                    kernels.invariant_linear(x[w.in_features], w.data, None, w.out_features)

        def onednn_packed() -> None:
            for layer in onednn:
                for (_, k), w in zip(SHAPES, layer):
                    torch.ops.mkldnn._linear_pointwise(x[k], w, None, "none", [], "")

        def gemv() -> None:
            for layer in plain:
                for w in layer:
                    kernels.gemv(x[w.shape[1]], w, None)

        runs: dict[str, Callable[[], None]] = {"column blocks": column_blocks, "oneDNN packed": onednn_packed}
        if rows <= 16:
            runs["gemv (plain)"] = gemv
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            run()  # warm: oneDNN builds its primitive for the shape
        for _ in range(rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        cells = [
            f"{name} {statistics.median(t) * 1e3:8.2f} ms ({macs_per_row * rows / statistics.median(t) / 1e9:5.1f} "
            f"GMAC/s)"
            for name, t in times.items()
        ]
        ratio = statistics.median(a / b for a, b in zip(times["column blocks"], times["oneDNN packed"]))
        print(f"rows {rows:5d}: {'  '.join(cells)}  column blocks / oneDNN {ratio:.3f}", flush=True)


def _steps(batches: list[int], steps: int) -> None:
    from engine import LLM, SamplingParams
    from engine import platform as engine_platform

    choose = engine_platform.cpu_linear
    prompt_len = 200
    for batch in batches:
        engines, llms = {}, []
        for name, declined in (("engine's choice", False), ("oneDNN packed", True)):
            engine_platform.cpu_linear = (lambda backend, dtype: None) if declined else choose
            try:
                llm = LLM(
                    None,
                    quantization="none",
                    dtype="float32",
                    max_model_len=prompt_len + 2 * steps + 64,
                    max_num_batched_tokens=2048,
                    enable_prefix_caching=False,
                )
            finally:
                engine_platform.cpu_linear = choose
            llms.append(llm)
            engine, model = llm.engine, llm.engine.runner.model
            params = SamplingParams(max_tokens=2 * steps + 32, temperature=0, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"r{i}", [(i + 11 * j) % 20000 + 50 for j in range(prompt_len)], params)
            while len(engine.step()) < batch:  # the prompts, then every sequence in decode
                pass
            engine.step()
            engines[f"{name} ({model.linear.name}, {'fused' if model.fused is not None else 'unfused'})"] = engine
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(steps):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
        (first, a), (second, b) = times.items()
        ratio = statistics.median(y / x for x, y in zip(a, b))
        print(
            f"{batch:3d} x {prompt_len} tokens: {first} {statistics.median(a) * 1e3:.2f} ms, {second} "
            f"{statistics.median(b) * 1e3:.2f} ms; the second / the first {ratio:.3f}",
            flush=True,
        )
        for llm in llms:
            llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256,2048")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps-batches", default="1,4,16,64", help="'' skips the decode steps")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    print(cpu_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.rows:
        _products([int(r) for r in args.rows.split(",")], args.rounds)
    if args.steps_batches:
        _steps([int(b) for b in args.steps_batches.split(",")], args.steps)


if __name__ == "__main__":
    main()
