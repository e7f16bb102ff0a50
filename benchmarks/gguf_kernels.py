"""The GGUF block products against torch's on the embedded model's weights (`python -m benchmarks.gguf_kernels`).

For each row count: every quantized matrix of the embedded SmolLM2 GGUF multiplied once with the integer
kernel (int8 activations), with the bf16 tiles (where the build has AVX512-BF16), and, for reference,
with torch's product on the same weights already dequantized (what `--quantization none` reads).
CPU time (`time.process_time`), the best of several runs, and the streaming-read bandwidth measured
right before, so the single-row figure can be read against the memory floor. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from engine.kernels.quant import load_quant_kernels
from engine.loading.gguf_weights import iter_gguf_weights
from engine.loading.loader import embedded_gguf_path
from engine.profiling.memory_bandwidth import read_bandwidth
from engine.quantization.gguf_weight import GgufWeight


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def measure(weights: Sequence[GgufWeight], rows: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """ms per pass over `weights` for each product."""
    kernels = weights[0].kernels
    inputs = {w.in_features: torch.randn(rows, w.in_features, dtype=dtype) for w in weights}
    dense = [w.dequantize(dtype) for w in weights]

    def products(tile_min_rows: int) -> Callable[[], None]:
        def run() -> None:
            for w in weights:
                p = w.packed
                kernels.linear(
                    inputs[w.in_features], p.qs, p.d, p.m, w.out_features, p.nbp, w.fmt.code, p.layout, tile_min_rows
                )

        return run

    def torch_products() -> None:
        for w, matrix in zip(weights, dense):
            F.linear(inputs[w.in_features], matrix)

    timings = {"integer": products(1 << 62), "torch (float weights)": torch_products}
    if kernels.bf16_tiles:
        timings["bf16 tiles"] = products(1)
    return {name: best_seconds(run, repeats) * 1e3 for name, run in timings.items()}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gguf_kernels", description=__doc__)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = load_quant_kernels()
    weights = [
        w.interleaved() for _, w in iter_gguf_weights(embedded_gguf_path(), kernels, 9, 3) if isinstance(w, GgufWeight)
    ]  # in the layout the model multiplies (X16 where rows allow)
    nbytes = sum(w.nbytes for w in weights)
    macs = sum(w.in_features * w.out_features for w in weights)
    dtype = getattr(torch, args.dtype)
    print(f"{len(weights)} matrices, {nbytes / 1e6:.1f} MB; {args.threads} thread(s), {args.dtype} activations")
    for rows in (int(r) for r in args.rows.split(",")):
        bandwidth = read_bandwidth(torch.device("cpu"))
        results = measure(weights, rows, dtype, args.repeats)
        cells = "; ".join(
            f"{name} {ms:.2f} ms ({nbytes / ms / 1e6:.1f} GB/s, {macs * rows / ms / 1e6:.1f} GMAC/s)"
            for name, ms in results.items()
        )
        print(f"rows {rows:3d} (read bandwidth {bandwidth / 1e9:.1f} GB/s): {cells}", flush=True)


if __name__ == "__main__":
    main()
