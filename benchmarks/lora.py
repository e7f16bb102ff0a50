"""What serving LoRA adapters costs on the embedded model: `python -m benchmarks.lora`.

    python -m benchmarks.lora [--concurrency 16] [--adapters 8] [--rank 16] [--tokens 64] [--repeats 3]
    python -m benchmarks.lora --load-stall [--concurrency 16] [--adapters 8] [--rank 16]
    python -m benchmarks.lora --base 1b [--tokens 32]

`--base`: `embedded` (default, SmolLM2-135M) or `1b`, a random-weight Llama of TinyLlama-1.1B's shape (hidden
2048, 22 layers, 32 query and 4 KV heads, intermediate 5632) with the embedded model's tokenizer, written to a
temporary directory first (~2.3 GB in bf16; no download). What adapters cost is a matter of bytes: each rank-16
adapter over every projection is r * (in + out) per matrix against the base's in * out, so eight of them add ~29%
to a 135M model's weight bytes per decode step (a ceiling near 0.78x) but ~9% to a 1.1B one's.

One engine with `--enable-lora` (max_loras = --adapters, the GGUF dequantized: --quantization none) runs rounds of
`--concurrency` greedy requests of the same prompts: all on the base model, and spread over `--adapters`
random rank-`--rank` adapters (every projection targeted); a second engine without LoRA runs the base round
too (the plain model's own speed); the three rounds interleaved `--repeats` times. Figures:
output tokens per second of each round (the best repeat), and the ratios adapters / plain base and adapters /
base in the LoRA engine; the same per second of the process's CPU time (`tok_per_cpu_s`: on a loaded machine
run with OMP_NUM_THREADS=1, where it measures the cost whatever the preemption). `--micro` also times one projection's (gate|up) deltas for a decode batch five ways:
torch's slot-range products (the engine's before the native kernels), per-adapter index_select/index_add
segments, per-token gathered bmm, and the native kernels (csrc/lora_delta.h) with A rows grouped by slot (the
engine's) or read per token.

`--load-stall` measures instead what loading an adapter at run time costs the other streams: `--concurrency`
greedy streams on the base model and `--adapters` - 1 loaded adapters decode while a request names an adapter
registered but not loaded (the engine reads it in slices between steps, then copies it into a free slot in
the step that admits the request). Figures: the streams' inter-token gaps before the load (median) and from
the request's arrival to its first token (max, and the ratio max / median; the issue's bound is 2x), the gap
of the step admitting it beside that of a step admitting the same prompt for an adapter already loaded (its
prefill's share), and the adapter's load time (arrival to loaded).

The adapters are written as PEFT directories (adapter_config.json + adapter_model.safetensors) with random
A and B scaled so the outputs stay text-like; their content does not change the cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.machine import cpu_info
from engine.llm import LLM
from engine.lora.request import LoRAMix, LoRARequest
from engine.sampling.params import SamplingParams

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a paged key-value cache works in an inference server.",
    "List ten animals that live in the ocean and describe each in one sentence.",
    "What are the main causes of the French Revolution?",
]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, arch, rank: int, seed: int) -> Path:
    """A random PEFT LoRA directory for `arch` (every projection, alpha = 2 * rank)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {
        "self_attn.q_proj": (arch.hidden_size, q),
        "self_attn.k_proj": (arch.hidden_size, kv),
        "self_attn.v_proj": (arch.hidden_size, kv),
        "self_attn.o_proj": (q, arch.hidden_size),
        "mlp.gate_proj": (arch.hidden_size, arch.intermediate_size),
        "mlp.up_proj": (arch.hidden_size, arch.intermediate_size),
        "mlp.down_proj": (arch.intermediate_size, arch.hidden_size),
    }
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (width, out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, width, generator=generator) / width**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.002
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


ONE_B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
"""TinyLlama-1.1B's shape."""


def random_base(path: Path) -> Path:
    """A random-weight Llama of ONE_B's shape in bf16 at `path`, with the embedded model's tokenizer (its prompts
    tokenize as they do for the embedded model; the weights' values do not change what a step costs)."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.loading.loader import prepare_checkpoint

    embedded = prepare_checkpoint(None).path
    vocab = json.loads((embedded / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, bos_token_id=1, eos_token_id=2, **ONE_B)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (embedded / name).exists():
            shutil.copy(embedded / name, path / name)
    return path


def run_round(llm: LLM, concurrency: int, tokens: int, loras) -> tuple[float, float]:
    """Output tokens per second of one round of `concurrency` requests, and per second of the process's CPU
    time (with OMP_NUM_THREADS=1, a cost measure that a loaded machine's preemption leaves alone)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    results = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    return generated / elapsed, generated / cpu


def micro(arch, adapters: int, rank: int, rows: int, dtype: torch.dtype, kernels, calls: int = 200) -> dict[str, float]:
    """Microseconds for the gate|up deltas of a `rows`-token decode batch over `adapters` adapters, five ways
    (`kernels`: the native CPU kernels, None: those two left out)."""
    width, out = arch.hidden_size, 2 * arch.intermediate_size
    parts_rank = 2 * rank
    a = torch.randn(adapters, parts_rank, width, dtype=dtype) * 0.01  # [S, P, in]
    b = torch.randn(adapters, parts_rank, out, dtype=dtype) * 0.01  # [S, P, out]
    x = torch.randn(rows, width, dtype=dtype)
    base = torch.randn(rows, out, dtype=dtype)
    slot = torch.arange(rows) % adapters
    mixing = torch.zeros(rows, adapters, dtype=dtype)
    mixing[torch.arange(rows), slot] = 1
    mixing = mixing.repeat_interleave(parts_rank, dim=1)
    segments = [(s, torch.nonzero(slot == s)[:, 0]) for s in range(adapters)]
    token_slots = slot.to(torch.int32)[:, None].contiguous()  # [T, 1]
    token_scales = torch.ones(rows, 1)
    ranks = torch.full((adapters,), rank, dtype=torch.int32)
    widths = (arch.intermediate_size, arch.intermediate_size)

    def slot_range() -> None:
        shrunk = torch.mm(x, a.reshape(-1, width).t())
        shrunk.mul_(mixing)
        base.addmm_(shrunk, b.reshape(-1, out))

    def per_adapter() -> None:
        for s, index in segments:
            rows_x = x.index_select(0, index)
            base.index_add_(0, index, (rows_x @ a[s].t()) @ b[s])

    def gathered_bmm() -> None:
        shrunk = torch.bmm(a[slot], x[:, :, None])  # [T, P, 1]
        base.add_(torch.bmm(shrunk.transpose(1, 2), b[slot])[:, 0])

    def native(grouped: bool):
        return lambda: kernels.lora_add_(x, base, a, b, token_slots, token_scales, ranks, widths, grouped=grouped)

    ways = [("slot_range", slot_range), ("per_adapter_segments", per_adapter), ("gathered_bmm", gathered_bmm)]
    if kernels is not None:
        ways += [("native_grouped_by_slot", native(True)), ("native_per_token", native(False))]
    timings = {}
    for name, fn in ways:
        for _ in range(20):
            fn()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - start) / calls * 1e6)
        timings[name] = round(min(samples), 1)
    return timings


def load_stall(llm: LLM, adapter: Path, streams: int, loaded: int, warm_steps: int = 24) -> dict:
    """Inter-token gaps of `streams` decoding streams (the base and `loaded` adapters a0..) before and while
    the adapter at `adapter` loads for a new request (see the module docstring). Every stream decodes a token
    each step, so a stream's gap is the time between two steps' ends."""
    engine, manager = llm.engine, llm.engine.lora_manager
    manager.register(LoRARequest("cold", str(adapter)))
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    mixes = [None if i % (loaded + 1) == 0 else LoRAMix.single(f"a{i % (loaded + 1) - 1}") for i in range(streams)]
    prompt = llm.get_tokenizer().encode(PROMPTS[0])
    for i, mix in enumerate(mixes):
        engine.add_request(f"s{i}", prompt, params, lora=mix)
    one = SamplingParams(max_tokens=1, temperature=0)
    ends: list[float] = []
    first_token: dict[str, int] = {}  # request -> the step that gave its token
    arrival = loaded_step = None
    warm_at, cold_at = warm_steps // 2, warm_steps
    step = 0
    while "cold" not in first_token:
        if step == warm_at:  # the same prompt for an adapter already loaded: what admitting one costs alone
            engine.add_request("warm", prompt, one, lora=LoRAMix.single("a0" if loaded else "cold"))
        if step == cold_at:
            arrival = time.perf_counter()
            engine.add_request("cold", prompt, one, lora=LoRAMix.single("cold"))
        for out in engine.step():
            if out.request_id in ("warm", "cold") and out.new_token_ids:
                first_token[out.request_id] = step
        ends.append(time.perf_counter())
        if arrival is not None and loaded_step is None and "cold" in manager.loaded_names():
            loaded_step = step
        step += 1
    loaded_at = ends[loaded_step] if loaded_step is not None else ends[-1]
    engine.abort([f"s{i}" for i in range(streams)])
    while engine.has_work:
        engine.step()
    gaps = [b - a for a, b in zip(ends, ends[1:])]  # gaps[i]: the gap ending at step i + 1
    steady = [g for i, g in enumerate(gaps[3 : cold_at - 1], start=4) if i != first_token.get("warm")]
    during = gaps[cold_at - 1 : first_token["cold"]]  # steps cold_at .. the cold request's first token
    median = statistics.median(steady)
    return {
        "median_gap_ms": round(median * 1e3, 2),
        "max_gap_ms_during_load": round(max(during) * 1e3, 2),
        "ratio_max_during_load_vs_median": round(max(during) / median, 2),
        "steps_during_load": len(during),
        "gaps_ms_during_load": [round(g * 1e3, 1) for g in during],
        "gap_ms_step_admitting_cold": round(gaps[first_token["cold"] - 1] * 1e3, 2),
        "gap_ms_step_admitting_warm": round(gaps[first_token["warm"] - 1] * 1e3, 2),
        "load_ms_arrival_to_loaded": round((loaded_at - (arrival or 0.0)) * 1e3, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--micro", action="store_true")
    parser.add_argument("--load-stall", action="store_true")
    parser.add_argument("--base", choices=("embedded", "1b"), default="embedded")
    args = parser.parse_args()
    info = cpu_info()
    print(f"CPU: {info['model']} ({info['isa']}, {info['cores']} cores); load average {os.getloadavg()}")
    common = dict(dtype=args.dtype, quantization="none", max_model_len=512, max_num_seqs=args.concurrency)
    report: dict = {"cpu": info["model"], "isa": info["isa"], "load_average": os.getloadavg(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as base_dir:
        model = None if args.base == "embedded" else str(random_base(Path(base_dir)))
        measure(args, model, common, report)


def measure(args: argparse.Namespace, model: str | None, common: dict, report: dict) -> None:
    if args.load_stall:
        with (
            tempfile.TemporaryDirectory() as tmp,
            LLM(
                model,
                enable_lora=True,
                max_loras=args.adapters,
                max_lora_rank=args.rank,
                **{**common, "max_num_seqs": args.concurrency + 1},  # a seat for the new request
            ) as llm,
        ):
            arch = llm.engine.runner.model.arch
            for i in range(args.adapters - 1):  # one slot left for the adapter loaded at run time
                manager = llm.engine.lora_manager
                manager.add_lora(LoRARequest(f"a{i}", str(write_adapter(Path(tmp) / f"a{i}", arch, args.rank, i))))
            cold = write_adapter(Path(tmp) / "cold", arch, args.rank, 1000)
            report["load_stall"] = load_stall(llm, cold, args.concurrency, args.adapters - 1)
        report["load_average_after"] = os.getloadavg()
        print(json.dumps(report, indent=2))
        return
    with (
        tempfile.TemporaryDirectory() as tmp,
        LLM(model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **common) as llm,
        LLM(model, **common) as plain,
    ):
        arch = llm.engine.runner.model.arch
        manager = llm.engine.lora_manager
        for i in range(args.adapters):
            manager.add_lora(LoRARequest(f"a{i}", str(write_adapter(Path(tmp) / f"a{i}", arch, args.rank, i))))
        mixes = [LoRAMix.single(f"a{i % args.adapters}") for i in range(args.concurrency)]
        run_round(llm, args.concurrency, 4, mixes)  # warm-up
        run_round(plain, args.concurrency, 4, None)
        plain_base, base, lora = [], [], []
        for _ in range(args.repeats):  # interleaved, so a change in the machine's load touches all three
            plain_base.append(run_round(plain, args.concurrency, args.tokens, None))
            base.append(run_round(llm, args.concurrency, args.tokens, None))
            lora.append(run_round(llm, args.concurrency, args.tokens, mixes))
        report["dtype"] = str(llm.engine.model_dtype).removeprefix("torch.")
        if args.micro:
            kernels = llm.engine.runner.model.lora.native
            report["micro_us"] = micro(
                arch, args.adapters, args.rank, args.concurrency, llm.engine.model_dtype, kernels
            )
    for unit, index in (("tok_s", 0), ("tok_per_cpu_s", 1)):
        best = {
            name: max(r[index] for r in rounds)
            for name, rounds in (("plain_base", plain_base), ("lora_engine_base", base), ("lora_engine_adapters", lora))
        }
        report[unit] = {name: round(value, 1) for name, value in best.items()}
        report[f"{unit}_ratio_adapters_vs_plain_base"] = round(best["lora_engine_adapters"] / best["plain_base"], 3)
        report[f"{unit}_ratio_adapters_vs_lora_engine_base"] = round(
            best["lora_engine_adapters"] / best["lora_engine_base"], 3
        )
    report["median_tok_s_adapters"] = round(statistics.median(r[0] for r in lora), 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
