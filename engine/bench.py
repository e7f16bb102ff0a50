"""Offline throughput against HF transformers, side by side, in this process (no server).

Both run the same prompts (token ids) with the same weights and dtype in one
process, one after the other:
  - pagedserve: `LLM.generate` with continuous batching over the paged KV cache;
  - HF: `model.generate` on the prompts as one padded batch.
It prints output tokens/s for both and the ratio, then the single-stream decode
step time next to its physical floor: the bytes a step reads (every weight
matrix and the context's K/V) over this machine's streaming-read bandwidth,
measured in the same run (engine/profiling/memory_bandwidth.py); and, for reference, one
bare matrix-vector pass over all the weights (the faster of torch's product and the
model's own, e.g. the native small-batch kernel) with the weight bytes it streams per second.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from engine.llm import LLM
from engine.profiling.memory_bandwidth import kv_read_bytes, read_bandwidth, tensor_bytes
from engine.kernels.column_block_weight import PackedWeight
from engine.quantization.quantized_weight import QuantizedWeight
from engine.sampling.params import SamplingParams

_WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or has "
    "had not but one all new more first after also two time year city system people world music team "
    "history river station school village model paper data light water energy science road market"
).split()


def make_prompts(llm: LLM, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids, from random word salad."""
    rng = random.Random(seed)
    tokenizer = llm.get_tokenizer()
    prompts = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer.encode(" ".join(rng.choice(_WORDS) for _ in range(64)), add_special_tokens=False)
        prompts.append(ids[:length])
    return prompts


def bench_pagedserve(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(r.outputs[0].token_ids) == output_len for r in results)
    return len(prompts) * output_len / elapsed


def bench_hf(model, prompts: list[list[int]], output_len: int, pad_id: int) -> float:
    from transformers import GenerationConfig

    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=[], pad_token_id=pad_id)
    with torch.inference_mode():
        model.generate(
            ids[:2, :8],
            attention_mask=mask[:2, :8],
            generation_config=config.__class__(max_new_tokens=4, do_sample=False, eos_token_id=[], pad_token_id=pad_id),
        )
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, generation_config=config)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == longest + output_len
    return len(prompts) * output_len / elapsed


def single_stream_step_ms(llm: LLM, prompt: list[int], steps: int) -> float:
    engine = llm.engine
    engine.add_request("bench-single", prompt, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    engine.step()  # prefill
    timings = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        timings.append(time.perf_counter() - start)
    engine.abort(["bench-single"])
    engine.step()
    return statistics.median(timings) * 1e3


def weight_floor_ms(
    weights: Sequence[torch.Tensor], repeats: int, linear, dtype: torch.dtype, device: torch.device
) -> float:
    """One matrix-vector product per weight matrix, batch 1 (the faster of `F.linear` on plain copies and the
    model's own product): a reference, not a floor (see memory_bandwidth.py). With quantized weights only the
    model's own product runs (float copies of every matrix would take 4-8x their memory and read more bytes)."""
    arms = [(linear, list(weights))]
    if not any(isinstance(w, QuantizedWeight) for w in weights):
        arms.insert(0, (F.linear, [_plain(w, dtype) for w in weights]))
    widths = [w.in_features if isinstance(w, QuantizedWeight) else _plain(w, dtype).shape[1] for w in weights]
    inputs = [torch.randn(1, width, dtype=dtype, device=device) for width in widths]
    best = float("inf")
    with torch.inference_mode():
        for product, mats in arms:
            timings = []
            for _ in range(repeats):
                _synchronize(inputs[0].device)
                start = time.perf_counter()
                for x, w in zip(inputs, mats):
                    product(x, w, None)
                _synchronize(inputs[0].device)  # on CUDA the products only queue until then
                timings.append(time.perf_counter() - start)
            best = min(best, statistics.median(timings) * 1e3)
    return best


def _weights_kind(quantization: str) -> str:
    """How a report names the weights: their quantization, or `unquantized` (quantization "none")."""
    return "unquantized" if quantization == "none" else quantization


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain(weight, dtype: torch.dtype) -> torch.Tensor:
    """A weight as the model's product takes it -> a plain [out, in] tensor."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize(dtype)
    if isinstance(weight, PackedWeight):
        return weight.unpack()
    # torch's stubs do not declare the mkldnn layout (torch._mkldnn exists at run time)
    return weight.to_dense() if weight.layout == torch._mkldnn else weight  # type: ignore[attr-defined]


def run(args: argparse.Namespace) -> dict[str, float]:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=max(args.num_prompts, 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        batch_invariant=args.batch_invariant,
        quantization=args.quantization,
        profile=args.profile,
    )
    engine = llm.engine
    model = engine.runner.model
    assert model is not None  # a running engine's
    dtype = model.dtype
    prompts = make_prompts(llm, args.num_prompts, args.input_len, args.seed)
    report: dict[str, float] = {}
    profile = engine.profile
    report["step_ms"] = single_stream_step_ms(llm, prompts[0], args.single_steps)
    if profile is not None:
        print("single stream, " + profile.table(), flush=True)
        profile.reset()
    arch = model.arch
    weight_bytes = tensor_bytes(model.weight_tensors())
    step_bytes = weight_bytes + kv_read_bytes(
        arch.num_layers, args.input_len + args.single_steps // 2, arch.num_kv_heads, arch.head_dim, dtype
    )
    bandwidth = read_bandwidth(model.device)
    report["read_gb_s"] = bandwidth / 1e9
    report["step_mb"] = step_bytes / 1e6
    report["floor_ms"] = step_bytes / bandwidth * 1e3
    report["matvec_ms"] = weight_floor_ms(model.weight_tensors(), args.single_steps, model.linear, dtype, model.device)
    report["matvec_gb_s"] = weight_bytes / report["matvec_ms"] / 1e6
    kind = _weights_kind(model.quantization)
    print(
        f"single-stream decode step: {report['step_ms']:.2f} ms; floor {report['floor_ms']:.2f} ms "
        f"({report['step_mb']:.0f} MB of {kind} weights and K/V at {report['read_gb_s']:.1f} GB/s "
        f"streaming read); ratio {report['step_ms'] / report['floor_ms']:.2f}x (batch-1 products alone: "
        f"{report['matvec_ms']:.2f} ms = {report['matvec_gb_s']:.1f} GB/s)",
        flush=True,
    )
    report["pagedserve_tok_s"] = bench_pagedserve(llm, prompts, args.output_len)
    print(f"pagedserve: {report['pagedserve_tok_s']:.1f} output tok/s", flush=True)
    if profile is not None:
        print(f"{args.num_prompts} prompts, " + profile.table(), flush=True)
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        checkpoint_dir = str(_checkpoint_dir(args.model))
        del llm, engine, model
        gc.collect()
        hf_model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype)
        hf_model.eval()
        report["hf_tok_s"] = bench_hf(hf_model, prompts, args.output_len, pad_id=_pad_id(hf_model))
        print(f"HF transformers generate (padded batch): {report['hf_tok_s']:.1f} output tok/s", flush=True)
        report["ratio"] = report["pagedserve_tok_s"] / report["hf_tok_s"]
    _print_table(args, report, dtype)
    return report


def _checkpoint_dir(model: Optional[str]):
    from engine.loading.loader import prepare_checkpoint

    return prepare_checkpoint(model).path


def _pad_id(model) -> int:
    pad = model.generation_config.pad_token_id
    return pad if isinstance(pad, int) else 0


def _print_table(args, report: dict[str, float], dtype: torch.dtype) -> None:
    print()
    mode = ", batch-invariant" if args.batch_invariant else ""
    print(
        f"| {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
        f"{str(dtype).removeprefix('torch.')}{mode}, {torch.get_num_threads()} threads | output tok/s |"
    )
    print("|---|---|")
    print(f"| pagedserve | {report['pagedserve_tok_s']:.1f} |")
    if "hf_tok_s" in report:
        print(f"| HF transformers generate | {report['hf_tok_s']:.1f} |")
        print(f"| ratio | {report['ratio']:.2f}x |")
    print(
        f"| single-stream step / floor (bytes read / {report['read_gb_s']:.1f} GB/s) | {report['step_ms']:.2f} ms "
        f"/ {report['floor_ms']:.2f} ms = {report['step_ms'] / report['floor_ms']:.2f}x |"
    )
    print(f"| batch-1 products over the weights | {report['matvec_ms']:.2f} ms = {report['matvec_gb_s']:.1f} GB/s |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve bench offline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="of the weights and activations, for both (auto: the engine's choice for the model and device)",
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts generated at once")
    parser.add_argument("--input-len", type=int, default=128, help="tokens of each (random) prompt")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated for each prompt")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="pagedserve's token budget per step")
    parser.add_argument(
        "--single-steps", type=int, default=32, help="decode steps timed for the single-stream step time"
    )
    parser.add_argument("--skip-hf", action="store_true", help="measure pagedserve only")
    parser.add_argument("--batch-invariant", action="store_true", help="run pagedserve in batch-invariant mode")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "gguf", "int8", "int4", "awq", "gptq"],
        help="weight storage (gguf: a .gguf file's quantized blocks; its floor counts their bytes)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--profile", action="store_true", help="print where the steps' time goes, by phase")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
