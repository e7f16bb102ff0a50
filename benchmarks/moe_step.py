"""Decode step time of a mixture of experts against a dense model with the same active parameters.

    python -m benchmarks.moe_step [--dtype bfloat16] [--batches 1,8] [--layers 12] [--hidden 2048] [--threads N]

Both are random-weight checkpoints written by transformers to a temporary folder and served by the engine:
a Qwen3-MoE with 8 experts of intermediate size I, top-2 routing, and a Qwen3 whose dense MLP has
intermediate size 2 * I, with the same attention, norms and vocabulary, so a token multiplies the same number
of weights in both. For each batch size it puts that many requests in decode and prints the median step
time of each model and their ratio, after the CPU model and flags. At batch 1 the MoE reads what the dense
model reads plus the router; at larger batches the tokens spread over more experts, so the MoE reads more
weights per step than the dense model (up to all E experts: E / top_k times the dense MLP).

The default widths are Qwen3-30B-A3B's (hidden 2048, experts of 768) with fewer layers and experts, so that
neither model's weights stay in the CPU's last-level cache between steps: with a dense model small enough to
stay there, its steps read cached weights while the MoE's, whose experts change from token to token, come
from memory, and the ratio measures the cache rather than the MoE layer (try `--hidden 1024 --layers 4`).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.decode_steps import DecodeSteps

EXPERTS, TOP_K = 8, 2


def write_checkpoint(path: Path, moe: bool, args: argparse.Namespace) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.05,
    )
    if moe:
        config = AutoConfig.for_model(
            "qwen3_moe",
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=args.expert_intermediate,
            norm_topk_prob=True,
            intermediate_size=TOP_K * args.expert_intermediate,
            **fields,
        )
    else:
        config = AutoConfig.for_model("qwen3", intermediate_size=TOP_K * args.expert_intermediate, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    _tokenizer(args.vocab).save_pretrained(path)
    return path


def _tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` made-up words (the benchmark feeds token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    backend = Tokenizer(models.WordLevel(words, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="w1", eos_token="w2", pad_token="w0")


def run(args: argparse.Namespace) -> dict:
    """Rounds alternate between the two models and each keeps its best round's median: on a shared machine a
    burst of someone else's work then slows both alike or neither."""
    import torch

    from benchmarks.machine import cpu_info

    if args.threads:
        torch.set_num_threads(args.threads)
    report = {
        "machine": cpu_info(),
        "torch_threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "shape": {
            "layers": args.layers,
            "hidden": args.hidden,
            "experts": EXPERTS,
            "top_k": TOP_K,
            "expert_intermediate": args.expert_intermediate,
            "dense_intermediate": TOP_K * args.expert_intermediate,
        },
        "batches": {},
    }
    with tempfile.TemporaryDirectory(prefix="moe-step-") as tmp:
        dirs = {name: write_checkpoint(Path(tmp) / name, name == "moe", args) for name in ("moe", "dense")}
        for batch in args.batches:
            engines = {
                name: DecodeSteps(path, batch, args.rounds * args.steps + 8, args.prompt_len, dtype=args.dtype)
                for name, path in dirs.items()
            }
            best = {name: float("inf") for name in engines}
            for _ in range(args.rounds):
                for name, engine in engines.items():
                    best[name] = min(best[name], engine.median_ms(args.steps))
            for engine in engines.values():
                engine.llm.shutdown()
            del engines
            gc.collect()
            report["batches"][batch] = {**best, "ratio": best["moe"] / best["dense"]}
    return report


def print_report(report: dict) -> None:
    machine = report["machine"]
    print(
        f"CPU: {machine['model']} ({machine['cores']} cores usable; {', '.join(machine['flags'])}); "
        f"torch threads {report['torch_threads']}; {report['dtype']}"
    )
    print(f"shape: {json.dumps(report['shape'])}")
    print(f"{'batch':>5}  {'moe ms':>8}  {'dense ms':>8}  {'moe/dense':>9}")
    for batch, row in report["batches"].items():
        print(f"{batch:>5}  {row['moe']:8.2f}  {row['dense']:8.2f}  {row['ratio']:9.2f}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batches", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--expert-intermediate", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20, help="steps timed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON as well")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    report = run(args)
    print_report(report)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
