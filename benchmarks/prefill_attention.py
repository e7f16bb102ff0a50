"""A prompt chunk's attention on CPU: the native prefill kernels (csrc/prefill_attention_f32.cpp for float32,
prefill_attention.cpp for bf16) against the cpu backend's torch path for the same chunk (SDPA for a chunk that
starts its sequence; over a cached prefix, two flash calls merged by their log-sum-exps), in GFLOP/s.

    python -m benchmarks.prefill_attention [--dtype float32] [--kv-cache-dtype auto] [--arch native,haswell]
                                           [--rounds 9]

Each case is a chunk of Q queries over P cached tokens (heads over kv heads of head_dim), its K/V in a paged cache
of scattered blocks of 16 (in the queries' dtype, or bfloat16 or fp8 as `--kv-cache-dtype` stores it in a server);
the two paths are called in turn, `--rounds` times, and each reports its median. FLOPs:
4 * heads * head_dim * (Q * P + Q(Q+1)/2), q.k and p.v over the causal part. `--arch` builds the kernels for
other targets too (haswell: the AVX2 loops) on a CPU that runs them; torch's own kernel is this CPU's either way.
Run it alone: on 2 cores any other busy process changes the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.machine import cpu_line

# (chunk, prefix, heads, kv heads, head_dim)
CASES = (
    (2048, 0, 9, 3, 64),  # the embedded model's first chunk of a long prompt
    (2048, 2048, 9, 3, 64),  # its second
    (512, 3500, 32, 8, 128),  # a Llama-3-8B-shaped chunk late in a long prompt
    (2048, 2048, 32, 8, 128),
    (512, 3500, 12, 3, 128),
    (512, 3500, 32, 16, 64),  # rows 4 KB apart in a float32 cache, as at 32 x 8 x 128
    (256, 0, 9, 3, 64),  # a short prompt
    (8, 4000, 9, 3, 64),  # a few tokens after a prefix-cache hit
    (1, 4000, 32, 8, 128),
)


def _case(
    kernels,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    chunk: int,
    prefix: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    rounds: int,
):
    from engine.attention.cpu_backend import CpuAttentionBackend
    from engine.attention.layer_attention import LayerAttention
    from engine.attention.metadata import PrefillChunk

    generator = torch.Generator().manual_seed(0)
    context, block_size = prefix + chunk, 16
    blocks = -(-context // block_size)
    key_cache = torch.randn(blocks + 2, block_size, kv_heads, head_dim, generator=generator).to(cache_dtype)
    value_cache = torch.randn(blocks + 2, block_size, kv_heads, head_dim, generator=generator).to(cache_dtype)
    table = torch.randperm(blocks + 2, generator=generator)[:blocks].int()
    query = torch.randn(chunk, heads, head_dim, generator=generator).to(dtype)
    positions = torch.arange(prefix, context)
    slots = table.long()[positions // block_size] * block_size + positions % block_size
    key = key_cache.view(-1, kv_heads, head_dim)[slots].to(dtype)  # the step's own K/V, as written to the cache
    value = value_cache.view(-1, kv_heads, head_dim)[slots].to(dtype)
    metadata = PrefillChunk(query_start=0, query_len=chunk, context_len=context, block_table=table)
    layer = LayerAttention(scale=head_dim**-0.5)

    class TorchPath(CpuAttentionBackend):  # the same backend, with its native kernel declined
        def _native_prefill(self, *args) -> bool:
            return False

    native = CpuAttentionBackend(kernels)
    fallback = TorchPath(kernels)
    if not native._native_prefill(query, key_cache, value_cache):
        return None

    def run(backend) -> torch.Tensor:
        return backend._prefill(query, key, value, key_cache, value_cache, metadata, layer)

    difference = (run(native).float() - run(fallback).float()).abs().max().item()
    times: dict[str, list[float]] = {"native": [], "torch": []}
    for _ in range(rounds):
        for name, backend in (("native", native), ("torch", fallback)):
            start = time.perf_counter()
            run(backend)
            times[name].append(time.perf_counter() - start)
    flops = 4 * heads * head_dim * (chunk * prefix + chunk * (chunk + 1) / 2)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return flops, medians, difference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "fp8"), help="auto: the queries' dtype"
    )
    parser.add_argument("--arch", default="native", help="comma-separated -march targets to build the kernels for")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    from engine.kernels.cpu import load_cpu_kernels

    print(cpu_line())
    dtype = getattr(torch, args.dtype)
    cache_dtype = {"auto": dtype, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[args.kv_cache_dtype]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.dtype} queries, {cache_dtype} cache")
    for arch in args.arch.split(","):
        kernels = load_cpu_kernels(arch=arch)
        if kernels is None:
            print(f"[{arch}] the kernels did not build")
            continue
        for case in CASES:
            chunk, prefix, heads, kv_heads, head_dim = case
            label = f"[{arch}] {chunk} x {prefix}, {heads}/{kv_heads} x {head_dim}"
            result = _case(kernels, dtype, cache_dtype, *case, rounds=args.rounds)
            if result is None:
                print(f"{label}: no native kernel for {args.dtype} over {cache_dtype} in this build (or on this CPU)")
                continue
            flops, medians, difference = result
            native, fallback = medians["native"], medians["torch"]
            print(
                f"{label}: native {native * 1e3:.1f} ms = {flops / native / 1e9:.0f} GFLOP/s,"
                f" torch {fallback * 1e3:.1f} ms = {flops / fallback / 1e9:.0f} GFLOP/s,"
                f" native / torch {native / fallback:.2f}"
                f" (outputs differ by at most {difference:.1e})"
            )


if __name__ == "__main__":
    main()
