"""Decode speed with tensor (and pipeline) parallelism on this machine: N ranks of one thread each against one
process with N threads, at batch 1 and batch 16, in output tokens per second.

    python -m benchmarks.tensor_parallel [--tp 2] [--pipeline] [--dtype bfloat16] [--batches 1,16] [--layers 12]
    python -m benchmarks.tensor_parallel --experts 64 [--expert-intermediate 768]   # a mixture: TP and TP + EP

A random-weight Llama checkpoint written by transformers to a temporary folder (Llama-3-like proportions:
head_dim 64, 4 query heads per KV head, MLP 3.5x), served by two engines in this process: one with
`--tensor-parallel-size 1` and torch threads = N, one with N ranks (rank 0 here, the others in worker
processes), one thread each, each rank pinned to its share of the CPUs (this process's threads and CPUs are
set to each engine's before its rounds). `--pipeline` compares N pipeline stages of one thread each (as many steps in
flight as stages) in place of the tensor-parallel ranks. `--experts E` writes a Qwen3-MoE instead (E experts of
`--expert-intermediate`, top-8 routing as Qwen3-30B-A3B's, every layer sparse) and adds a third engine: the same
ranks with `--enable-expert-parallel` (E / N whole experts per rank instead of 1 / N of each one's width). Each
keeps `batch` requests in decode; rounds alternate between them and each keeps its best round's tokens per second,
printed after the CPU model and flags with each one's ratio to the one process. Every engine gives the same tokens
(greedy).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.decode_steps import DecodeSteps

EXPERT_TOP_K = 8  # (Qwen3-30B-A3B's)


def write_checkpoint(path: Path, args: argparse.Namespace) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.moe_step import _tokenizer

    mixture = (
        dict(
            num_experts=args.experts,
            num_experts_per_tok=min(EXPERT_TOP_K, args.experts),
            moe_intermediate_size=args.expert_intermediate,
            norm_topk_prob=True,
        )
        if args.experts
        else {}
    )
    config = AutoConfig.for_model(
        "qwen3_moe" if args.experts else "llama",
        **mixture,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 7 // 2,
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
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    _tokenizer(args.vocab).save_pretrained(path)
    return path


def steps(
    model_dir: Path,
    args: argparse.Namespace,
    batch: int,
    tp: int,
    threads: int,
    pp: int = 1,
    ep: bool = False,
    phases: int = 1,
) -> DecodeSteps:
    """An engine in decode whose requests last `phases` comparisons' rounds."""
    max_steps = phases * args.rounds * args.steps + 8
    return DecodeSteps(
        model_dir,
        batch,
        max_steps,
        args.prompt_len,
        threads,
        dtype=args.dtype,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        enable_expert_parallel=ep,
    )


def run(args: argparse.Namespace) -> dict:
    from benchmarks.machine import cpu_info

    report = {
        "machine": cpu_info(),
        "dtype": args.dtype,
        "tp": args.tp,
        "shape": {"layers": args.layers, "hidden": args.hidden, "heads": args.hidden // 64}
        | ({"experts": args.experts, "expert_intermediate": args.expert_intermediate} if args.experts else {}),
        "batches": {},
    }
    with tempfile.TemporaryDirectory(prefix="tp-bench-") as tmp:
        model_dir = write_checkpoint(Path(tmp) / "llama", args)
        for batch in args.batches:
            one = f"1 process x {args.tp} threads"
            splits = (  # (one distributed engine at a time: a process joins one torch.distributed group)
                {f"pp{args.tp} x 1 thread": (1, args.tp, False)}
                if args.pipeline
                else {f"tp{args.tp} x 1 thread": (args.tp, 1, False)}
            )
            if args.experts and not args.pipeline:
                splits[f"tp{args.tp} + ep x 1 thread"] = (args.tp, 1, True)
            single = steps(model_dir, args, batch, 1, args.tp, phases=len(splits))
            best = {one: 0.0} | {name: 0.0 for name in splits}
            for name, (tp, pp, ep) in splits.items():
                engines = {one: single, name: steps(model_dir, args, batch, tp, 1, pp=pp, ep=ep)}
                for _ in range(args.rounds):
                    for each, engine in engines.items():
                        best[each] = max(best[each], engine.tokens_per_s(args.steps))
                engines[name].llm.shutdown()
                del engines
                gc.collect()
            single.llm.shutdown()
            del single
            gc.collect()
            report["batches"][batch] = {
                name: {"tok/s": rate, "vs one process": rate / best[one]} for name, rate in best.items()
            }
    return report


def print_report(report: dict) -> None:
    machine = report["machine"]
    print(
        f"CPU: {machine['model']} ({machine['cores']} cores usable; {', '.join(machine['flags'])}); "
        f"{report['dtype']}; shape {json.dumps(report['shape'])}"
    )
    for batch, row in report["batches"].items():
        print(
            f"batch {batch}: "
            + ", ".join(f"{name} {v['tok/s']:.1f} tok/s ({v['vs one process']:.2f}x)" for name, v in row.items())
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="ranks (and the one process's threads)")
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="as many pipeline stages (one thread each) instead of tensor-parallel ranks",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batches", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE of this many experts (0: a dense Llama)")
    parser.add_argument("--expert-intermediate", type=int, default=768, help="each expert's width (with --experts)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20, help="steps timed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=32)
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
