"""Hybrid models on CPU: a random Qwen3.5-like (Gated DeltaNet) or Granite 4.0-H-like (Mamba-2) checkpoint served by
the engine against transformers' own forward (its torch fallbacks of the scans) on the same weights.

Times, in alternating rounds on one machine: a prompt's prefill, and greedy decoding of a batch of requests (each
prompt distinct, prefilled outside the timed decode by the engine's own measure: the decode time is the batch's time
less its prefills'). Prints the CPU model and its flags; a figure from one machine says nothing about another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from benchmarks.machine import cpu_info

COMMON = dict(
    vocab_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def family_config(family: str, hidden: int, layers: int) -> dict:
    """Three recurrent layers to one attention layer, as the releases mix them."""
    kinds = ["recurrent" if (i + 1) % 4 else "attention" for i in range(layers)]
    if family == "qwen3_5":
        return dict(
            COMMON,
            architectures=["Qwen3_5ForCausalLM"],
            model_type="qwen3_5_text",
            hidden_size=hidden,
            num_hidden_layers=layers,
            head_dim=128,
            intermediate_size=hidden * 11 // 4,
            layer_types=["linear_attention" if k == "recurrent" else "full_attention" for k in kinds],
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
        )
    return dict(
        COMMON,
        architectures=["GraniteMoeHybridForCausalLM"],
        model_type="granitemoehybrid",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=512,
        shared_intermediate_size=hidden * 2,
        num_local_experts=0,
        layer_types=["mamba" if k == "recurrent" else "attention" for k in kinds],
        position_embedding_type="nope",
        mamba_n_heads=hidden * 2 // 64,
        mamba_d_head=64,
        mamba_d_state=128,
        mamba_n_groups=1,
        mamba_expand=2,
        mamba_chunk_size=256,
    )


def write_checkpoint(path: Path, config: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.engine.factories import make_tiny_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
    model.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return model.eval()


def run(args: argparse.Namespace) -> dict:
    from engine import LLM, SamplingParams

    prompts = [[(i * 7 + 13 * r) % 500 + 3 for i in range(args.prompt_len)] for r in range(args.batch)]
    rounds: dict[str, list[float]] = {key: [] for key in ("engine_prefill", "engine_decode", "hf_prefill", "hf_decode")}
    with tempfile.TemporaryDirectory() as directory:
        hf = write_checkpoint(Path(directory), family_config(args.family, args.hidden, args.layers))
        greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        # (no prefix caching: every round computes its prompts, as transformers does; benchmarks/hybrid_prefix_cache.py
        # times the hits)
        settings = dict(
            dtype="bfloat16",
            device="cpu",
            max_model_len=4096,
            max_num_batched_tokens=4096,
            enable_prefix_caching=False,
        )
        with LLM(directory, **settings) as llm, torch.inference_mode():
            llm.generate([{"prompt_token_ids": prompts[0]}], first, use_tqdm=False)  # (warm-up)
            ids = torch.tensor(prompts)
            hf.generate(ids[:1, :16], max_new_tokens=2, do_sample=False)
            for _ in range(args.rounds):
                started = time.perf_counter()
                llm.generate([{"prompt_token_ids": p} for p in prompts], first, use_tqdm=False)
                prefill = time.perf_counter() - started
                started = time.perf_counter()
                llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
                rounds["engine_prefill"].append(prefill / args.batch)
                rounds["engine_decode"].append((time.perf_counter() - started - prefill) / (args.new_tokens - 1))
                started = time.perf_counter()
                hf(ids)
                prefill = time.perf_counter() - started
                started = time.perf_counter()
                hf.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
                rounds["hf_prefill"].append(prefill / args.batch)
                rounds["hf_decode"].append((time.perf_counter() - started - prefill) / (args.new_tokens - 1))
    medians = {key: statistics.median(values) for key, values in rounds.items()}
    return {
        "cpu": cpu_info(),
        "family": args.family,
        "shape": {"hidden": args.hidden, "layers": args.layers, "prompt": args.prompt_len, "batch": args.batch},
        "ms": {key: round(value * 1e3, 1) for key, value in medians.items()},
        "engine_vs_hf": {
            "prefill": round(medians["engine_prefill"] / medians["hf_prefill"], 2),
            "decode": round(medians["engine_decode"] / medians["hf_decode"], 2),
        },
    }


def model_arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the random checkpoint's settings (benchmarks/hybrid_prefix_cache.py's too)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--family", default="qwen3_5", choices=("qwen3_5", "granite"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = model_arguments(__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    report = run(build_parser().parse_args(argv))
    cpu = report["cpu"]
    print(f"{cpu['model']} ({cpu['isa']}, {cpu['cores']} cores): {report['family']} {report['shape']}")
    print(json.dumps(report["ms"]), json.dumps(report["engine_vs_hf"]))


if __name__ == "__main__":
    main()
