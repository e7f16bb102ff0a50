"""Prefix caching for hybrid models on CPU: time to first token with snapshots of the recurrent states against the
same engine without prefix caching, on a random Qwen3.5-like or Granite 4.0-H-like checkpoint (benchmarks/
hybrid_models.py's shapes).

Two workloads, run in alternating rounds by two engines on the same weights (each round's tokens its own, so no
round hits another's):
- chat: a system prompt, then turns of a user message and a greedy answer; each turn's prompt is the whole
  conversation so far. With snapshots a turn restores the previous turn's end and computes the new message alone.
- shared: requests one after another with one long system prompt and distinct questions. The second keeps the
  state where the system prompt's blocks end (the junction); from the third on, each restores it.

Prints the CPU model and its flags; a figure from one machine says nothing about another.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.hybrid_models import family_config, model_arguments, write_checkpoint
from benchmarks.machine import cpu_info


def _tokens(seed: int, count: int) -> list[int]:
    """`count` token ids of their own (no two seeds share a block)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(count)]


def chat(llm, offset: int, args: argparse.Namespace) -> list[float]:
    """Each turn's time to first token (seconds): the conversation so far and a new user message."""
    from engine import SamplingParams

    answer = SamplingParams(max_tokens=args.answer_len, temperature=0, ignore_eos=True)
    conversation = _tokens(offset, args.system_len)
    ttfts = []
    for turn in range(args.turns):
        conversation += _tokens(offset + 1000 * (turn + 1), args.message_len)
        ttfts.append(_first_token_time(llm, conversation))
        (result,) = llm.generate([{"prompt_token_ids": conversation}], answer, use_tqdm=False)
        conversation += list(result.outputs[0].token_ids)
    return ttfts


def shared(llm, offset: int, args: argparse.Namespace) -> list[float]:
    """Each request's time to first token (seconds): the shared system prompt and its own question."""
    system = _tokens(offset, args.shared_len)
    return [
        _first_token_time(llm, system + _tokens(offset + 1000 * (user + 1), args.message_len))
        for user in range(args.users)
    ]


def _first_token_time(llm, prompt: list[int]) -> float:
    """Seconds to a request's first token, alone on the engine: its prefill (hit or not) and one sample."""
    from engine import SamplingParams

    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict:
    from engine import LLM

    times: dict[str, dict[str, list[list[float]]]] = {
        workload: {"snapshots": [], "no_cache": []} for workload in ("chat", "shared")
    }
    settings = dict(dtype="bfloat16", device="cpu", max_model_len=4096, max_num_batched_tokens=4096)
    with tempfile.TemporaryDirectory() as directory:
        write_checkpoint(Path(directory), family_config(args.family, args.hidden, args.layers))
        with LLM(directory, **settings) as cached, LLM(directory, **settings, enable_prefix_caching=False) as cold:
            snapshots = cached.engine.scheduler.kv_cache_manager.snapshots
            assert snapshots is not None, "the hybrid engine keeps no snapshots"
            for engine in (cached, cold):  # (warm-up)
                shared(engine, 7, argparse.Namespace(**{**vars(args), "users": 1, "shared_len": 64}))
            for round_index in range(args.rounds):
                for name, llm in (("snapshots", cached), ("no_cache", cold)):
                    offset = 11 * (round_index + 1)
                    times["chat"][name].append(chat(llm, offset, args))
                    times["shared"][name].append(shared(llm, offset + 5, args))
            restored = snapshots.num_restored
    report: dict = {"cpu": cpu_info(), "family": args.family, "restored": restored}
    for workload, runs in times.items():
        medians = {name: [statistics.median(column) for column in zip(*rounds)] for name, rounds in runs.items()}
        report[workload] = {
            "ttft_ms": {name: [round(t * 1e3, 1) for t in values] for name, values in medians.items()},
            "ratio": [round(a / b, 3) for a, b in zip(medians["snapshots"], medians["no_cache"])],
        }
    report["shape"] = {
        "hidden": args.hidden,
        "layers": args.layers,
        "system": args.system_len,
        "message": args.message_len,
        "answer": args.answer_len,
        "shared": args.shared_len,
    }
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = model_arguments(__doc__.splitlines()[0])
    parser.add_argument("--system-len", type=int, default=256, help="the chat's system prompt")
    parser.add_argument("--message-len", type=int, default=64, help="each user message, or question")
    parser.add_argument("--answer-len", type=int, default=32)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--shared-len", type=int, default=1500, help="the shared workload's system prompt")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    report = run(build_parser().parse_args(argv))
    cpu = report["cpu"]
    print(f"{cpu['model']} ({cpu['isa']}, {cpu['cores']} cores): {report['family']} {report['shape']}")
    for workload in ("chat", "shared"):
        print(workload, json.dumps(report[workload]))
    print("snapshots restored:", report["restored"])


if __name__ == "__main__":
    main()
