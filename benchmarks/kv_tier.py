"""TTFT of a shared system prompt from the disk KV tier after a restart: `python -m benchmarks.kv_tier`.

The embedded model; a `--system-tokens` (1,500) system prompt (the KJV text of benchmarks/data) followed by a
short user turn that differs per request. Three TTFTs, each the min and median over `--repeats` requests
(`max_tokens` 1: the time to the first token), the prefix cache emptied before each, so that every request
finds nothing in the pool:

    cold            no tier: the whole prompt computed
    cold + write    --kv-cache-dir on an empty directory: computed, every full block written through (the cost
                    of saving on commit, which the background writer keeps off the step)
    restart         a new engine on that directory: the system prompt's blocks restored from disk, the user
                    turn computed (the files are in the OS page cache, as after a restart on the same host)

The issue's target: restart <= 0.3x cold. The ratios are of figures taken in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.machine import cpu_info
from engine.llm import LLM
from engine.sampling.params import SamplingParams

TEXT = Path(__file__).resolve().parent / "data" / "genesis_37-41_kjv.txt"
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def ttfts(llm: LLM, system: list[int], turns: list[list[int]]) -> list[float]:
    """Seconds to the first token of each request system + turn, the prefix cache emptied before each."""
    times = []
    for turn in turns:
        assert llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
        started = time.perf_counter()
        llm.generate({"prompt_token_ids": system + turn}, FIRST_TOKEN, use_tqdm=False)
        times.append(time.perf_counter() - started)
    return times


def summary(times: list[float]) -> dict[str, float]:
    return {"min_ms": round(min(times) * 1e3, 1), "median_ms": round(statistics.median(times) * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    print(json.dumps({"machine": cpu_info()}))
    with LLM(dtype=args.dtype) as llm:
        tokenizer = llm.get_tokenizer()
        ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
        system = ids[: args.system_tokens]
        turns = [
            tokenizer.encode(f"\nQuestion {n}: who was sold into Egypt?", add_special_tokens=False)
            for n in range(args.repeats)
        ]
        llm.generate({"prompt_token_ids": turns[0]}, FIRST_TOKEN, use_tqdm=False)  # warm-up (kernels, pools)
        cold = ttfts(llm, system, turns)
    with tempfile.TemporaryDirectory() as directory:
        with LLM(dtype=args.dtype, kv_cache_dir=directory) as llm:
            llm.generate({"prompt_token_ids": turns[0]}, FIRST_TOKEN, use_tqdm=False)
            written = ttfts(llm, system, turns)
        with LLM(dtype=args.dtype, kv_cache_dir=directory) as llm:
            llm.generate({"prompt_token_ids": turns[0]}, FIRST_TOKEN, use_tqdm=False)
            restart = ttfts(llm, system, turns)
            tier = llm.engine.stats().kv_tier
            assert tier is not None
            on_disk = sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())
    result = {
        "system_tokens": len(system),
        "cold": summary(cold),
        "cold_write_through": summary(written),
        "restart_from_disk": summary(restart),
        "restart_over_cold": round(min(restart) / min(cold), 3),
        "write_through_over_cold": round(min(written) / min(cold), 3),
        "tier_hit_tokens_per_request": tier.hit_tokens // len(turns),
        "tier_read_mib_per_request": round(tier.read_bytes / len(turns) / 2**20, 1),
        "tier_dir_mib": round(on_disk / 2**20, 1),
        "target": "restart_over_cold <= 0.3",
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
