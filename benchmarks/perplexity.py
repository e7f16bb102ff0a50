"""Quality of the weight and KV formats: perplexity on a fixed text, and greedy agreement with a reference.

    python -m benchmarks.perplexity                          # every row, the embedded model
    python -m benchmarks.perplexity --rows bf16,int8,int4    # some rows
    python -m benchmarks.perplexity --agreement-prompts 32 --agreement-tokens 64 --reference bf16

A row is a name for engine settings: fp32, bf16, int8, int4 (group 32, the default), int4-g64,
int4-g128, int8-head / int4-head (the LM head quantized too), kv-bf16 (an fp32 model with a bf16 KV cache, prefill in chunks of 64 tokens
so that it reads the cache; fp32-chunked is its fp32-cache twin), q8_0 (the model requantized to a
Q8_0 GGUF, dequantized on load) and, with the native GGUF path (`--quantization gguf`), q8_0-native and
q4_1-native (fp32: prompts go through the dense product of the same weights), q4_1-native-bf16 (bf16
activations: prompt windows go through the bf16 tiles of the interleaved blocks) and q4_1-native-int8 (prompts in chunks of 4 tokens, so every product is the decode
kernel's, with int8 activations). A row the engine cannot build here is reported with the reason.

Perplexity: the text (benchmarks/data/genesis_37-41_kjv.txt) in windows of `--window` tokens, each
scored by the engine's prompt logprobs (`LLM.generate` with `prompt_logprobs`): exp of the mean negative
logprob of every token after a window's first.

Greedy agreement: the reference row generates `--agreement-tokens` greedy tokens after each of
`--agreement-prompts` prompts (slices of the text); every other row reads prompt + those tokens
(teacher forcing) and a position agrees when the reference's token is that row's argmax (its rank is 1).
Teacher forcing scores every position on the same context, so one early difference does not decide the
rest of the sequence.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

TEXT = Path(__file__).resolve().parent / "data" / "genesis_37-41_kjv.txt"
ROWS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    # prefill chunks of 64 tokens: later chunks read the earlier ones' K/V from the (bf16) cache
    "kv-bf16": {"dtype": "float32", "kv_cache_dtype": "bfloat16", "max_num_batched_tokens": 64, "max_num_seqs": 32},
    "fp32-chunked": {"dtype": "float32", "max_num_batched_tokens": 64, "max_num_seqs": 32},
    # the same with an fp8 (e4m3) cache under a bf16 model: every chunk's attention reads stored e4m3 K/V
    "kv-fp8": {"dtype": "bfloat16", "kv_cache_dtype": "fp8", "max_num_batched_tokens": 64, "max_num_seqs": 32},
    # e5m2 (2 mantissa bits): the torch backend, whose widened gathers read it (the cpu kernels read e4m3 only)
    "kv-fp8-e5m2": {
        "dtype": "bfloat16",
        "kv_cache_dtype": "fp8_e5m2",
        "attention_backend": "torch",
        "max_num_batched_tokens": 64,
        "max_num_seqs": 32,
    },
    "bf16-chunked": {"dtype": "bfloat16", "max_num_batched_tokens": 64, "max_num_seqs": 32},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "int4": {"dtype": "bfloat16", "quantization": "int4"},  # group 32, the default
    "int4-g128": {"dtype": "bfloat16", "quantization": "int4", "quantization_group_size": 128},
    "int4-g64": {"dtype": "bfloat16", "quantization": "int4", "quantization_group_size": 64},
    "int8-head": {"dtype": "bfloat16", "quantization": "int8", "lm_head": True},
    "int4-head": {"dtype": "bfloat16", "quantization": "int4", "lm_head": True},
    "q8_0": {"dtype": "float32", "gguf": "Q8_0"},
    "q8_0-native": {"dtype": "float32", "gguf": "Q8_0", "quantization": "gguf"},
    "q4_1-native": {"dtype": "float32", "quantization": "gguf"},  # fp32 prompts: the dense product
    "q4_1-native-bf16": {"dtype": "bfloat16", "quantization": "gguf"},  # prompt windows through the bf16 tiles
    # prompts in chunks of 4 tokens: every product is the decode kernel's (int8 activations)
    "q4_1-native-int8": {"dtype": "float32", "quantization": "gguf", "max_num_batched_tokens": 4, "max_num_seqs": 4},
}
DEFAULT_ROWS = (
    "fp32,bf16,fp32-chunked,kv-bf16,bf16-chunked,kv-fp8,kv-fp8-e5m2,int8,int4,int4-g64,int4-g128,int8-head,int4-head,"
    "q8_0,q8_0-native,q4_1-native,q4_1-native-bf16,q4_1-native-int8"
)


@dataclass
class RowResult:
    name: str
    perplexity: Optional[float] = None
    agreement: Optional[float] = None
    seconds: float = 0.0
    error: Optional[str] = None
    settings: dict = field(default_factory=dict)


def build_llm(model: Optional[str], row: dict[str, Any], cache_dir: Path, window: int):
    """The engine for a row (building the Q8_0 GGUF first when the row needs it)."""
    from engine.llm import LLM

    settings = {k: v for k, v in row.items() if k not in ("gguf", "lm_head")}
    if "gguf" in row:
        model = str(requantized_gguf(model, row["gguf"], cache_dir))
    settings.setdefault("max_num_batched_tokens", max(window + 1, 512))
    llm = LLM(model, device="cpu", max_model_len=max(window + 1, 512), enable_prefix_caching=False, **settings)
    if row.get("lm_head"):
        quantize_lm_head(llm)
    return llm


def quantize_lm_head(llm) -> None:
    """Replace the model's LM head by its quantized form (the engine keeps it float by default)."""
    model = llm.engine.runner.model
    if not model.arch.tie_word_embeddings:
        raise ValueError("the -head rows need a model with tied embeddings (its float LM head is the embedding)")
    model.lm_head = model.linear.prepare(model.quantizer(model.embed))


def requantized_gguf(model: Optional[str], quant: str, cache_dir: Path) -> Path:
    """The model's weights as dequantized on load, requantized to `quant` in a GGUF (cached by name)."""
    from engine.loading.loader import EMBEDDED_GGUF_NAME, embedded_gguf_path

    if model is not None:
        raise ValueError("the q8_0 rows requantize the embedded GGUF only")
    target = cache_dir / f"{Path(EMBEDDED_GGUF_NAME).stem}.requantized-{quant}.gguf"
    if not target.exists():
        from benchmarks.gguf_requantize import requantize

        requantize(embedded_gguf_path(), target, quant)
    return target


def token_windows(tokenizer, text: str, window: int) -> list[list[int]]:
    ids = tokenizer.encode(text)
    return [ids[i : i + window] for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) > 1]


def perplexity(llm, windows: list[list[int]]) -> float:
    from engine.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    results = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll = [-entry.logprob for result in results for entry in result.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll))


def agreement_prompts(tokenizer, text: str, count: int, length: int = 32) -> list[list[int]]:
    ids = tokenizer.encode(text)
    stride = max((len(ids) - length) // count, 1)
    return [ids[i * stride : i * stride + length] for i in range(count)]


def greedy_continuations(llm, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from engine.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in results]


def agreement(llm, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """Share of the reference's greedy tokens that are also this engine's argmax on the same context."""
    from engine.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    inputs = [{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations)]
    results = llm.generate(inputs, params, use_tqdm=False)
    hits = total = 0
    for prompt, result in zip(prompts, results):
        for entry in result.prompt_logprobs[len(prompt) :]:
            hits += entry.rank == 1
            total += 1
    return hits / total


def evaluate(args: argparse.Namespace) -> list[RowResult]:
    """Every row: perplexity, and agreement with the reference row's greedy tokens."""
    from engine.text.tokenizer import load_tokenizer  # noqa: F401  (imports the engine before timing)

    cache_dir = Path(args.cache_dir or tempfile.mkdtemp(prefix="pagedserve-ppl-"))
    text = TEXT.read_text()
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    reference = None
    if args.agreement_prompts:
        llm = build_llm(args.model, ROWS[args.reference], cache_dir, args.window)
        prompts = agreement_prompts(llm.get_tokenizer(), text, args.agreement_prompts)
        reference = (prompts, greedy_continuations(llm, prompts, args.agreement_tokens))
        del llm
    results = []
    for name in names:
        result = RowResult(name, settings=ROWS[name])
        started = time.monotonic()
        try:
            llm = build_llm(args.model, ROWS[name], cache_dir, args.window)
        except Exception as exc:  # a row this build cannot run (e.g. the native GGUF path not merged)
            result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            results.append(result)
            print(f"{name:12s} not run: {result.error}", flush=True)
            continue
        windows = token_windows(llm.get_tokenizer(), text, args.window)[: args.max_windows or None]
        result.perplexity = perplexity(llm, windows)
        if reference is not None:
            result.agreement = agreement(llm, *reference)
        result.seconds = time.monotonic() - started
        del llm
        results.append(result)
        agree = "" if result.agreement is None else f"  agreement {100 * result.agreement:.1f}%"
        print(f"{name:12s} perplexity {result.perplexity:.4f}{agree}  ({result.seconds:.0f} s)", flush=True)
    return results


def table(results: list[RowResult], baseline: str) -> str:
    base = next((r.perplexity for r in results if r.name == baseline and r.perplexity), None)
    lines = ["| row | perplexity | vs " + baseline + " | greedy agreement |", "|---|---:|---:|---:|"]
    for r in results:
        if r.perplexity is None:
            lines.append(f"| {r.name} | not run: {r.error} | | |")
            continue
        delta = f"{100 * (r.perplexity / base - 1):+.2f}%" if base else ""
        agree = "" if r.agreement is None else f"{100 * r.agreement:.1f}%"
        lines.append(f"| {r.name} | {r.perplexity:.3f} | {delta} | {agree} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.perplexity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated, from: {', '.join(ROWS)}")
    parser.add_argument("--window", type=int, default=512, help="tokens per scored window")
    parser.add_argument("--max-windows", type=int, default=0, help="score only the first N windows (0: all)")
    parser.add_argument("--reference", default="bf16", help="the row whose greedy tokens the others should pick")
    parser.add_argument("--agreement-prompts", type=int, default=32, help="0 skips the agreement")
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument("--cache-dir", default=None, help="where requantized GGUFs are kept (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    results = evaluate(args)
    print()
    print(table(results, args.reference))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=2))


if __name__ == "__main__":
    main()
