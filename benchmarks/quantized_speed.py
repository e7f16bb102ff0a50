"""Speed of the weight-only formats on this machine: the products of one decoder layer per batch size
(float, int8 and int4 through torch's weight-only kernels, and through the dequantize-then-`F.linear`
fallback), and decode through the engine (single stream TPOT, 16 concurrent streams' output tokens/s).

    python -m benchmarks.quantized_speed [--rows 1,4,16,64] [--group-sizes 32,128] [--skip-engine]

The layer's shapes are the embedded SmolLM2-135M's (hidden 576, intermediate 1536, 9 heads, 3 KV heads):
q|k|v 960x576, o 576x576, gate|up 3072x576, down 576x1536. Times are the best of `--repeats` runs.
int4 is measured at each of `--group-sizes` (default: the server's, 32), in the products and in the engine.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Optional

import torch

from engine.quantization.int4_groups import DEFAULT_INT4_GROUP_SIZE

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
ENGINE_ROWS = {
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "int4": {"dtype": "bfloat16", "quantization": "int4"},  # one row per --group-sizes value
    "fp32": {"dtype": "float32"},
    "fp32-int8": {"dtype": "float32", "quantization": "int8"},
}


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def layer_products(
    dtype: torch.dtype, rows_list: list[int], repeats: int, group_sizes: list[int]
) -> dict[str, list[float]]:
    """ms for the four products of one layer, per variant and batch size."""
    from engine.layers.linear import select_linear
    from engine.quantization.int4_groups import Int4Groups
    from engine.quantization.int4_weight import Int4Weight
    from engine.quantization.int8_weight import Int8Weight

    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    floats = [torch.randn(shape, generator=generator).to(dtype) / 24 for shape in SHAPES]
    linear = select_linear(cpu, dtype)
    prepared = [linear.prepare(w) for w in floats]
    int8 = [Int8Weight.quantize(w) for w in floats]
    variants = {
        f"{str(dtype).removeprefix('torch.')} ({linear.name})": lambda x, i: linear(x, prepared[i], None),
        "int8 kernel": lambda x, i: int8[i].matmul(x),
        "int8 dequantize+linear": lambda x, i: int8[i].matmul_dequantized(x),
    }
    for group_size in group_sizes:
        groups = [Int4Groups.quantize(w, group_size) for w in floats]
        int4 = [Int4Weight(g, cpu) for g in groups]
        int4_nibbles = [Int4Weight(g, cpu, use_kernel=False) for g in groups]  # the fallback's storage
        variants[f"int4-g{group_size} kernel"] = lambda x, i, w=int4: w[i].matmul(x)
        variants[f"int4-g{group_size} dequantize+linear"] = lambda x, i, w=int4_nibbles: w[i].matmul(x)
    results: dict[str, list[float]] = {name: [] for name in variants}
    for rows in rows_list:
        inputs = [torch.randn(rows, w.shape[1], generator=generator).to(dtype) for w in floats]
        for name, product in variants.items():
            results[name].append(best_ms(lambda: [product(inputs[i], i) for i in range(len(SHAPES))], repeats))
    return results


def engine_decode(settings: dict, tokens: int) -> tuple[float, float]:
    """(single-stream ms per output token, output tokens/s of 16 concurrent requests)."""
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    llm = LLM(None, max_num_seqs=16, enable_prefix_caching=False, **settings)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 164))}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    first = SamplingParams(temperature=0, max_tokens=1)
    start = time.perf_counter()
    llm.generate([prompt], first, use_tqdm=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    tpot = (time.perf_counter() - start - prefill) / (tokens - 1) * 1e3
    prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(16)]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return tpot, 16 * tokens / (time.perf_counter() - start)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.quantized_speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--engine-rows", default="bf16,int8,int4", help=f"from: {', '.join(ENGINE_ROWS)}")
    parser.add_argument(
        "--group-sizes",
        default=str(DEFAULT_INT4_GROUP_SIZE),
        help="int4 group sizes to measure, comma-separated, from 32, 64, 128 (default: the "
        f"server's, {DEFAULT_INT4_GROUP_SIZE})",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    group_sizes = [int(g) for g in args.group_sizes.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for dtype_name in args.dtypes.split(","):
        results = layer_products(getattr(torch, dtype_name), rows, args.repeats, group_sizes)
        print(f"\n| one layer's products, {dtype_name} activations | " + " | ".join(f"{r} rows" for r in rows) + " |")
        print("|---|" + "---:|" * len(rows))
        for name, times in results.items():
            print(f"| {name} | " + " | ".join(f"{t:.3f} ms" for t in times) + " |")
    if args.skip_engine:
        return
    print("\n| engine, embedded model | single-stream TPOT | 16 streams, output tok/s |\n|---|---:|---:|")
    for name, settings in engine_rows(args.engine_rows.split(","), group_sizes):
        tpot, throughput = engine_decode(settings, args.tokens)
        print(f"| {name} | {tpot:.1f} ms | {throughput:.0f} |", flush=True)


def engine_rows(names: list[str], group_sizes: list[int]) -> list[tuple[str, dict]]:
    """(label, LLM settings) per row; int4 once per group size (the default one left unset, as served)."""
    rows = []
    for name in names:
        if ENGINE_ROWS[name].get("quantization") != "int4":
            rows.append((name, ENGINE_ROWS[name]))
            continue
        for group_size in group_sizes:
            explicit = {} if group_size == DEFAULT_INT4_GROUP_SIZE else {"quantization_group_size": group_size}
            rows.append((f"{name}-g{group_size}", {**ENGINE_ROWS[name], **explicit}))
    return rows


if __name__ == "__main__":
    main()
