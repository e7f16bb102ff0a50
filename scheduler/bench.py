"""Scheduler overhead per step, on made-up requests (no model).

Keeps `--num-running` requests decoding (prefix caching on, prompts sharing a
system prefix), replacing each finished request with a new one, and reports the
median wall time of `schedule()` + `update_from_output()` per step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from scheduler.config import CacheConfig, SchedulerConfig
from scheduler.request import Request
from scheduler.scheduler import Scheduler


def _new_request(rng: random.Random, index: int, system_prompt: list[int], args) -> Request:
    user = [rng.randrange(32000) for _ in range(args.prompt_len - len(system_prompt))]
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=system_prompt + user,
        max_tokens=rng.randint(args.output_len // 2, args.output_len),
        eos_token_ids=frozenset({2}),
    )


def run(args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(args.seed)
    max_len = args.prompt_len + args.output_len
    blocks_per_request = -(-max_len // args.block_size)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=args.num_running,
            max_num_batched_tokens=max(args.num_running, 2048),
            max_model_len=max_len,
        ),
        CacheConfig(
            block_size=args.block_size,
            num_blocks=blocks_per_request * args.num_running + 64,
            enable_prefix_caching=True,
        ),
    )
    system_prompt = [rng.randrange(32000) for _ in range(args.prompt_len // 2)]
    next_index = 0
    for _ in range(args.num_running):
        scheduler.add_request(_new_request(rng, next_index, system_prompt, args))
        next_index += 1
    # Warm up until every request is past its prompt.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.requests.values()):
        out = scheduler.schedule()
        scheduler.update_from_output(out, {rid: [rng.randrange(3, 32000)] for rid in out.num_scheduled_tokens})

    timings: list[float] = []
    cpu_timings: list[float] = []  # this thread's CPU time: what other processes on the machine don't inflate
    batch_sizes = []
    for _ in range(args.steps):
        sampled_pool = [rng.randrange(3, 32000) for _ in range(args.num_running)]
        c0, t0 = time.thread_time(), time.perf_counter()
        out = scheduler.schedule()
        c1, t1 = time.thread_time(), time.perf_counter()
        # What the model runner returns: one sampled token per request at the end of its sequence.
        sampled = {rid: [sampled_pool[i % len(sampled_pool)]] for i, rid in enumerate(out.num_scheduled_tokens)}
        c2, t2 = time.thread_time(), time.perf_counter()
        finished = scheduler.update_from_output(out, sampled)
        c3, t3 = time.thread_time(), time.perf_counter()
        timings.append((t1 - t0) + (t3 - t2))
        cpu_timings.append((c1 - c0) + (c3 - c2))
        batch_sizes.append(len(out.num_scheduled_tokens))
        for step_output in finished:
            if step_output.status.is_finished:
                scheduler.add_request(_new_request(rng, next_index, system_prompt, args))
                next_index += 1
    timings.sort()
    return {
        "median_ms": statistics.median(timings) * 1e3,
        "median_cpu_ms": statistics.median(cpu_timings) * 1e3,
        "p90_ms": timings[int(len(timings) * 0.9)] * 1e3,
        "mean_batch": statistics.mean(batch_sizes),
        "hit_rate": scheduler.kv_cache_manager.prefix_cache_stats.hit_rate,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve bench scheduler", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-running", type=int, default=256, help="requests kept decoding")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens of each prompt (half of them shared)")
    parser.add_argument(
        "--output-len",
        type=int,
        default=256,
        help="most tokens a request generates (each draws from half of it up to it)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--steps", type=int, default=2000, help="steps timed")
    parser.add_argument("--seed", type=int, default=0, help="seed of the made-up tokens and lengths")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    result = run(args)
    print(
        f"scheduler step (schedule + update_from_output), {args.num_running} running, "
        f"prefix caching on, {args.steps} steps: median {result['median_ms']:.3f} ms wall "
        f"({result['median_cpu_ms']:.3f} ms CPU), p90 {result['p90_ms']:.3f} ms wall, mean batch {result['mean_batch']:.1f} requests, "
        f"prefix hit rate {result['hit_rate']:.2f}"
    )


if __name__ == "__main__":
    main()
