"""What n-gram, suffix or draft-model speculation buys on the embedded model: `python -m benchmarks.spec_decode`.

    workloads  copy: the model asked to repeat a passage of its prompt (drafts copied from the prompt are
               right most of the time); free: a story from a short instruction (little to copy)
    modes      one engine with `--speculative-config` ngram (`--method suffix`: suffix decoding; `--method draft_model`:
               a draft model, by default the embedded GGUF on its quantized kernels drafting for itself
               dequantized); each request runs with `"speculative": false` and
               with speculation on, alternating, `--repeats` times, so both share the weights, the threads and
               the machine's state of the moment
    figures    TPOT (time per output token after the first, the median over the repeats) of a single stream and,
               with `--concurrency C`, of C streams together (their mean TPOT); the process's CPU time per output
               token over the same span (steadier than wall time on a shared machine); the ratios off / on (above
               1: faster with speculation); the mean acceptance length (tokens a drafted step produced) and the
               acceptance rate (accepted / drafted tokens)

Greedy (temperature 0), so both modes produce the same tokens and the comparison is per token of the same text.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from benchmarks.machine import cpu_info
from engine.llm import LLM
from engine.loading.loader import embedded_gguf_path
from engine.sampling.params import SamplingParams

PASSAGE = (Path(__file__).resolve().parent / "data" / "genesis_37-41_kjv.txt").read_text()[:900]
WORKLOADS = {
    "copy": [{"role": "user", "content": f"Repeat the following passage exactly, word for word.\n\n{PASSAGE}"}],
    "free": [
        {
            "role": "user",
            "content": "Write a short story about a lighthouse keeper who finds a strange message in a bottle.",
        }
    ],
}


def run_once(llm: LLM, messages: list[dict], params: SamplingParams, concurrency: int) -> tuple[float, float]:
    """(mean TPOT, process CPU seconds per output token after the first of each stream) of `concurrency`
    identical conversations run together. CPU time is the steadier figure on a shared machine: another
    process's work stretches wall time, not this one's CPU time."""
    engine = llm.engine
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode(tokenizer.render_chat(messages, True), add_special_tokens=False)
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(concurrency)]
    for request_id in ids:
        engine.add_request(request_id, prompt, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts = dict.fromkeys(ids, 0)
    cpu_first: Optional[float] = None
    while engine.has_work:
        outputs = engine.step()
        now, cpu = time.perf_counter(), time.process_time()
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                counts[out.request_id] += len(out.new_token_ids)
        if cpu_first is None and len(first) == concurrency:
            cpu_first, counted_from = cpu, sum(counts.values())
        cpu_last = cpu
    tpots = [(last[i] - first[i]) / (counts[i] - 1) for i in ids if counts[i] > 1]
    assert cpu_first is not None
    return statistics.mean(tpots), (cpu_last - cpu_first) / max(sum(counts.values()) - counted_from, 1)


def measure(llm: LLM, name: str, max_tokens: int, repeats: int, concurrency: int) -> dict:
    stats_before = llm.engine.stats().speculation
    on_params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    off_params = on_params.replace(speculative=False)
    off, on = [], []
    for _ in range(repeats):
        off.append(run_once(llm, WORKLOADS[name], off_params, concurrency))
        on.append(run_once(llm, WORKLOADS[name], on_params, concurrency))
    stats = llm.engine.stats().speculation
    drafts = stats.num_drafts - stats_before.num_drafts
    drafted = stats.num_draft_tokens - stats_before.num_draft_tokens
    accepted = stats.num_accepted_tokens - stats_before.num_accepted_tokens
    off_ms, on_ms = (statistics.median(run[0] for run in runs) * 1e3 for runs in (off, on))
    off_cpu, on_cpu = (statistics.median(run[1] for run in runs) * 1e3 for runs in (off, on))
    row = {
        "workload": name,
        "concurrency": concurrency,
        "tpot_off_ms": round(off_ms, 2),
        "tpot_on_ms": round(on_ms, 2),
        "speedup": round(off_ms / on_ms, 2),
        "cpu_ms_per_token_off": round(off_cpu, 2),
        "cpu_ms_per_token_on": round(on_cpu, 2),
        "cpu_speedup": round(off_cpu / on_cpu, 2),
        "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else None,
        "acceptance_rate": round(accepted / drafted, 2) if drafted else None,
        "drafted_steps_per_request": round(drafts / (repeats * concurrency), 1),
    }
    print(json.dumps(row), file=sys.stderr)  # progress: a row as soon as it is measured
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--method", choices=("ngram", "suffix", "draft_model"), default="ngram")
    parser.add_argument(
        "--draft-model",
        default=None,
        help="draft_model: the draft's checkpoint or .gguf (default: the embedded GGUF, a quantized self-draft)",
    )
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1])
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="the speculative config's pause: no drafts in a step with more decoding requests than this",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); 1 keeps the "
        "figures steady on a machine shared with other work, where a thread of a team that waits "
        "for a descheduled one stalls every parallel region",
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = {
        "method": args.method,
        "num_speculative_tokens": args.num_speculative_tokens,
        "disable_by_batch_size": args.disable_by_batch_size,
    }
    if args.method == "ngram":
        config.update(prompt_lookup_min=2, prompt_lookup_max=5)
    if args.method == "draft_model":
        config["model"] = args.draft_model or str(embedded_gguf_path())
    with LLM(args.model, dtype=args.dtype, speculative_config=config) as llm:
        run_once(llm, WORKLOADS["free"], SamplingParams(max_tokens=8, temperature=0), 1)  # warm-up
        rows = [measure(llm, name, args.max_tokens, args.repeats, c) for c in args.concurrency for name in WORKLOADS]
        print(
            json.dumps(
                {
                    "machine": cpu_info(),
                    "dtype": str(llm.engine.model_dtype),
                    "threads": torch.get_num_threads(),
                    "speculative_config": config,
                    "max_tokens": args.max_tokens,
                    "results": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
