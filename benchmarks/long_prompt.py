"""A long prompt against the machine: prefill FLOP/s as a share of the matrix unit's measured peak, and the
decode step at that context against its physical floor, on the embedded model's unquantized and GGUF paths, in the
dtype a server takes on this CPU (`--dtype auto`: bf16 where it has native bf16, else float32).

    python -m benchmarks.long_prompt [--prompt-tokens 4149] [--paths none,gguf] [--profile]

Everything compared is measured in the same run: the CPU model and flags, the model dtype's matrix peak (torch's
product of two large square matrices in it: oneDNN, which runs bf16 on the AMX tiles where the CPU has them),
float32's too for scale when that is bf16, the streaming-read bandwidth, then per path the TTFT of one prompt, its FLOPs,
FLOP/s, % of that peak, and the single-stream decode TPOT at that context against the floor.

Prefill FLOPs (one multiply-add = 2 FLOPs; T prompt tokens, L layers, H query heads of head_dim d):

    products   2 * P * T             P: the parameters of the layers' products (embeddings excluded)
    LM head    2 * V * hidden        once: only the last prompt token's logits are computed
    attention  4 * L * H * d * T(T+1)/2    q.k and p.v, 2 * d FLOPs each, over the causal half

Decode floor (one token): (weight bytes as stored + K/V bytes of the context) / read bandwidth, the bandwidth
read again before each round of decode steps; the ratio is the median of the rounds'.
`--profile`: torch's profiler over one prefill per path, the top operators by CPU time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.machine import cpu_line


class Clock:
    """Wall time and this process's CPU time per thread: on a shared machine the wall clock counts the time other
    processes held the cores; CPU time / threads counts only this process's (spinning OpenMP waits included)."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def seconds(self) -> tuple[float, float]:
        """(wall, CPU / threads) since the clock started."""
        cpu = (time.process_time() - self.cpu) / torch.get_num_threads()
        return time.perf_counter() - self.wall, cpu


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 10) -> tuple[float, float]:
    """FLOP/s of torch's product of two [size, size] matrices in `dtype`, (by wall, by CPU time), best of `repeats`."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b  # oneDNN's kernel choice and the thread pool warm up
    wall = cpu = float("inf")
    for _ in range(repeats):
        clock = Clock()
        a @ b
        w, c = clock.seconds()
        wall, cpu = min(wall, w), min(cpu, c)
    return 2 * size**3 / wall, 2 * size**3 / cpu


def prefill_flops(model: Any, tokens: int) -> dict[str, float]:
    """The formula of the module docstring, by parts."""
    arch = model.arch
    params = sum(_elements(w) for w in model.weight_tensors()[:-1])  # the last one is the LM head
    attention = 4 * arch.num_layers * arch.num_heads * arch.head_dim * tokens * (tokens + 1) / 2
    head = 2 * arch.vocab_size * arch.hidden_size
    return {"products": 2 * params * tokens, "attention": attention, "head": head}


def _elements(weight: Any) -> int:
    """A weight's logical element count: a tensor's, a quantized or packed weight's [out, in]."""
    if isinstance(weight, torch.Tensor):
        return weight.numel()
    if hasattr(weight, "out_features"):
        return weight.out_features * weight.in_features
    return weight.data.numel()


def run_path(
    quantization: str,
    prompt_tokens: int,
    decode_steps: int,
    decode_rounds: int,
    chunk: int,
    profile: bool,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
) -> dict:
    from engine import LLM, SamplingParams
    from engine.profiling.memory_bandwidth import kv_read_bytes, read_bandwidth, read_buffer, tensor_bytes

    llm = LLM(
        None,
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=prompt_tokens + decode_rounds * decode_steps + 16,
        max_num_seqs=1,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    model = engine.runner.model
    assert model is not None
    params = SamplingParams(max_tokens=decode_rounds * decode_steps + 2, temperature=0, ignore_eos=True)
    prompt = [(7 * j) % 20000 + 100 for j in range(prompt_tokens)]
    # a shorter prompt first warms the kernels (oneDNN's choices, the libraries' pages): a first chunk and one
    # that continues it, as the measured prompt has
    engine.add_request("warm", prompt[: min(prompt_tokens, chunk + 256)], SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests:
        engine.step()
    buffer = read_buffer(torch.device("cpu"))
    engine.add_request("measured", prompt, params)
    clock = Clock()
    while not any(out.new_token_ids for out in engine.step()):
        pass
    ttft = clock.seconds()
    rounds = []  # per round: the read bandwidth right before, the median step by wall and by CPU time
    for _ in range(decode_rounds):
        bandwidth = read_bandwidth(torch.device("cpu"), repeats=3, buffer=buffer)
        timings = []
        for _ in range(decode_steps):
            clock = Clock()
            engine.step()
            timings.append(clock.seconds())
        rounds.append((bandwidth, statistics.median(t[0] for t in timings), statistics.median(t[1] for t in timings)))
    del buffer
    while engine.has_unfinished_requests:
        engine.step()
    if profile:
        _profile_prefill(engine, prompt)
    arch = model.arch
    floor_bytes = tensor_bytes(model.weight_tensors()) + kv_read_bytes(
        arch.num_layers, prompt_tokens, arch.num_kv_heads, arch.head_dim, engine.runner.kv_cache.spec.dtype
    )
    flops = prefill_flops(model, prompt_tokens)
    llm.shutdown()
    return {"ttft_s": ttft, "flops": flops, "rounds": rounds, "floor_bytes": floor_bytes}


def print_decode(path: str, tokens: int, rounds: list[tuple[float, float, float]], floor_bytes: int) -> None:
    """Each round's TPOT against the floor at the bandwidth read right before it (the VM's bandwidth swings from
    one second to the next: a floor read once, minutes away from the steps, moved the ratio by up to 1.8x),
    then the median ratio."""
    ratios = []
    for bandwidth, wall, cpu in rounds:
        floor = floor_bytes / bandwidth
        ratios.append((wall / floor, cpu / floor))
        print(
            f"[{path}]   read {bandwidth / 1e9:.1f} GB/s, floor {floor * 1e3:.2f} ms; TPOT {wall * 1e3:.2f} ms "
            f"(CPU time {cpu * 1e3:.2f}) = {wall / floor:.2f}x",
            flush=True,
        )
    print(
        f"[{path}] decode TPOT at {tokens} tokens: {statistics.median(r[1] for r in rounds) * 1e3:.2f} ms "
        f"(CPU time {statistics.median(r[2] for r in rounds) * 1e3:.2f} ms); floor {floor_bytes / 1e6:.1f} MB at "
        f"{min(r[0] for r in rounds) / 1e9:.1f}-{max(r[0] for r in rounds) / 1e9:.1f} GB/s; median ratio "
        f"{statistics.median(r[0] for r in ratios):.2f}x ({statistics.median(r[1] for r in ratios):.2f}x by CPU time)",
        flush=True,
    )


def _profile_prefill(engine: Any, prompt: list[int]) -> None:
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    engine.add_request("profiled", prompt, SamplingParams(max_tokens=1, temperature=0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests:
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=4149)
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps per round")
    parser.add_argument(
        "--decode-rounds", type=int, default=5, help="rounds of decode steps, each after a read-bandwidth test"
    )
    parser.add_argument("--paths", default="none,gguf", help="--quantization values to run, comma-separated")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the prefill chunk")
    parser.add_argument("--profile", action="store_true", help="torch profiler over one more prefill per path")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="what the KV cache stores (auto: the model's; fp8)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="the model's dtype (auto: as a server takes it, bfloat16 where the CPU has native bf16, else float32)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.profiling.memory_bandwidth import read_bandwidth

    print(cpu_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    from engine.loading.model_config import cpu_has_fast_bf16

    # the peak of the dtype the model runs in: on a CPU without native bf16, torch's bf16 product is no peak of
    # the machine (under 1 GFLOP/s on an AVX2 EPYC) and the model runs in float32 anyway
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_has_fast_bf16() else "float32")
    peak = matmul_peak(getattr(torch, dtype))
    line = f"{dtype} matrix peak (2048^3 torch/oneDNN): {peak[0] / 1e9:.0f} GFLOP/s by wall, {peak[1] / 1e9:.0f} by CPU time"
    if dtype == "bfloat16":
        fp32 = matmul_peak(torch.float32)
        line += f"; float32: {fp32[0] / 1e9:.0f} / {fp32[1] / 1e9:.0f}"
    print(line)
    print(f"streaming read: {read_bandwidth(torch.device('cpu')) / 1e9:.1f} GB/s")
    for path in args.paths.split(","):
        result = run_path(
            path,
            args.prompt_tokens,
            args.decode_steps,
            args.decode_rounds,
            args.max_num_batched_tokens,
            args.profile,
            args.kv_cache_dtype,
            dtype,
        )
        flops = result["flops"]
        total = sum(flops.values())
        rates = [total / seconds for seconds in result["ttft_s"]]
        print(
            f"[{path}] {args.prompt_tokens}-token prompt: {total / 1e12:.3f} TFLOP (products "
            f"{flops['products'] / 1e12:.3f}, attention {flops['attention'] / 1e12:.3f}, head "
            f"{flops['head'] / 1e12:.4f}); TTFT {result['ttft_s'][0]:.2f} s = {rates[0] / 1e9:.0f} GFLOP/s = "
            f"{100 * rates[0] / peak[0]:.1f}% of the peak (wall); by CPU time {result['ttft_s'][1]:.2f} s = "
            f"{100 * rates[1] / peak[1]:.1f}%",
            flush=True,
        )
        print_decode(path, args.prompt_tokens, result["rounds"], result["floor_bytes"])
    print(f"load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
