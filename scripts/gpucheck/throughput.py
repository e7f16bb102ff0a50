"""Part: output tokens/s on nano-vllm's benchmark workload, Qwen3-0.6B-shaped random weights.

The workload is nano-vllm's bench.py (github.com/GeeeekExplorer/nano-vllm):

    seed(0)
    prompt_token_ids = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    max_tokens = [randint(100, 1024) for _ in range(256)]        # 133,966 output tokens in all

with ignore_eos and temperature 0.6, drawn here from `random.Random(0)` in the same order. The
engine is driven step by step (as `LLM.generate` does) so that each step is timed and the run
stops at the part's deadline (then `completed` is false and the figures cover what ran). A step
is a "full-batch decode" when every request is in the running batch and each computes one
decode token; its floor is the bytes it must read (every weight matrix once, plus the K/V of
each request's context) at the H200's 4.8 TB/s.
"""

from __future__ import annotations

import random
import statistics
import time

from gpucheck.common import (
    HBM_BYTES_PER_S,
    PartContext,
    build_llm,
    cuda_graph_modes,
    ensure_checkpoint,
    error_record,
    free_memory,
    kv_bytes_per_token,
    logger,
    shutdown,
    speed_block_size,
    weight_read_bytes,
    with_torch_fallback,
)

TEARDOWN_S = 8  # left at the deadline to abort, release the engine and save


def workload(quick: bool) -> dict:
    if quick:
        return dict(num_requests=8, min_len=16, max_len=48, max_token_id=1000, seed=0, temperature=0.6)
    return dict(num_requests=256, min_len=100, max_len=1024, max_token_id=10000, seed=0, temperature=0.6)


def make_requests(spec: dict) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's draws, in its order: every prompt (its length, then its ids), then every output length."""
    rng = random.Random(spec["seed"])
    low, high, count = spec["min_len"], spec["max_len"], spec["num_requests"]
    prompts = [[rng.randint(0, spec["max_token_id"]) for _ in range(rng.randint(low, high))] for _ in range(count)]
    output_lens = [rng.randint(low, high) for _ in range(count)]
    return prompts, output_lens


def engine_settings(ctx: PartContext) -> dict:
    backend = ctx.options.get("throughput_backend") or "auto"
    if ctx.quick:
        return dict(
            dtype="bfloat16",
            device=ctx.device.type,
            attention_backend=backend,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=128,
            block_size=16,
            kv_cache_memory="32MiB",
            enable_prefix_caching=True,
        )
    # nano-vllm's defaults: max_num_seqs 512, max_num_batched_tokens 16384, max_model_len 4096, 0.9 of memory
    return dict(
        dtype="bfloat16",
        device=ctx.device.type,
        attention_backend=backend,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        max_model_len=4096,
        block_size=speed_block_size(backend, ctx.device),
        gpu_memory_utilization=0.9,
        enable_prefix_caching=True,
    )


class StepRecorder:
    """Keeps the last step message the runner executed (the runner is wrapped, not changed)."""

    def __init__(self, runner):
        self.last = None
        execute = runner.execute

        def recording_execute(scheduler_output):
            self.last = scheduler_output
            return execute(scheduler_output)

        runner.execute = recording_execute


def run(ctx: PartContext) -> None:
    spec = workload(ctx.quick)
    prompts, output_lens = make_requests(spec)
    settings = engine_settings(ctx)
    result = ctx.result
    result.update(
        workload={
            **spec,
            "source": "nano-vllm bench.py (random.Random(0): prompts, then output lengths)",
            "total_prompt_tokens": sum(map(len, prompts)),
            "total_output_tokens": sum(output_lens),
            "ignore_eos": True,
        },
        model="qwen3-0.6b" + ("-quick" if ctx.quick else ""),
        engine=settings,
        runs={},
    )
    modes = cuda_graph_modes()
    result["cuda_graphs"] = (
        "absent (the engine takes no enforce_eager yet): eager only" if len(modes) == 1 else "measured"
    )
    ctx.save()
    model_dir = ensure_checkpoint(ctx.work_dir, "qwen3-0.6b", ctx.quick, ctx.device)
    for index, (label, extra) in enumerate(modes):
        share = ctx.remaining() / (len(modes) - index)  # split what is left between the modes
        deadline = time.time() + share - TEARDOWN_S
        try:
            result["runs"][label] = with_torch_fallback(
                lambda s: run_mode(model_dir, s, prompts, output_lens, spec["temperature"], deadline),
                {**settings, **extra},
                ctx,
                min_left_s=60,
            )
        except Exception as exc:  # noqa: BLE001 - recorded, the next mode goes on
            result["runs"][label] = error_record(exc)
        ctx.save()
    runs = result["runs"].values()
    result["status"] = "ok" if all(r.get("completed") for r in runs) else "partial"


def run_mode(model_dir, settings: dict, prompts, output_lens, temperature: float, deadline: float) -> dict:
    from engine import SamplingParams

    started = time.perf_counter()
    llm = build_llm(model_dir, **settings)
    try:
        engine = llm.engine
        record = {
            "build_s": round(time.perf_counter() - started, 1),
            "backend": engine.runner.backend.name,
            "kv_cache_tokens": engine.runner.kv_cache.num_tokens,
        }
        warm = SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p[:32]} for p in prompts[:2]], warm, use_tqdm=False)
        recorder = StepRecorder(engine.runner)
        for i, (prompt, max_tokens) in enumerate(zip(prompts, output_lens)):
            engine.add_request(
                f"tp-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
            )
        record.update(drive(engine, recorder, {f"tp-{i}": len(p) for i, p in enumerate(prompts)}, deadline))
        model = engine.runner.model
        weights, per_token = weight_read_bytes(model), kv_bytes_per_token(engine.runner.kv_cache.spec)
        record.update(
            weight_read_bytes=weights,
            kv_bytes_per_token=per_token,
            hbm_bytes_per_s=HBM_BYTES_PER_S,
            num_preemptions=engine.stats().num_preemptions,
        )
        full_batch = min(len(prompts), settings["max_num_seqs"])
        record["full_batch_decode"] = full_batch_stats(record.pop("_steps"), full_batch, weights, per_token)
        logger.info(
            "throughput (%s): %.1f output tok/s over %d tokens in %.1f s (%s); full-batch decode step %s",
            record["backend"],
            record["output_tok_s"],
            record["output_tokens"],
            record["elapsed_s"],
            "completed" if record["completed"] else "stopped at the deadline",
            record["full_batch_decode"],
        )
        return record
    finally:
        shutdown(llm)
        del llm
        free_memory()


def drive(engine, recorder: StepRecorder, prompt_lens: dict[str, int], deadline: float) -> dict:
    """Step until done or the deadline: output tokens, time, and per step (seconds, batch, decode-only, KV tokens)."""
    steps = []
    output_tokens = 0
    completed = True
    start = time.perf_counter()
    while engine.has_work:
        if time.time() > deadline:
            completed = False
            break
        step_start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - step_start
        output_tokens += sum(len(out.new_token_ids) for out in outputs)
        so = recorder.last
        if so is None or so.is_empty:
            continue
        decode_only = all(
            n == 1 and so.num_computed_tokens[r] >= prompt_lens.get(r, 0) for r, n in so.num_scheduled_tokens.items()
        )
        kv_tokens = sum(so.num_computed_tokens[r] + n for r, n in so.num_scheduled_tokens.items())
        steps.append((seconds, len(so.num_scheduled_tokens), decode_only, kv_tokens))
    elapsed = time.perf_counter() - start
    if not completed:
        engine.abort(engine.unfinished_request_ids())
        while engine.has_work:
            engine.step()
    decode_s = sum(s[0] for s in steps if s[2])
    return {
        "completed": completed,
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 2),
        "output_tok_s": round(output_tokens / elapsed, 1) if elapsed else 0.0,
        "steps": len(steps),
        "decode_only_steps": sum(1 for s in steps if s[2]),
        "decode_only_s": round(decode_s, 2),
        "steps_with_prefill_s": round(sum(s[0] for s in steps) - decode_s, 2),
        "_steps": steps,
    }


def full_batch_stats(steps: list, batch: int, weight_bytes: int, kv_per_token: int) -> dict:
    """Mean decode-step time at full batch next to its memory floor (weights + KV read / 4.8 TB/s)."""
    full = [(sec, kv) for sec, reqs, decode_only, kv in steps if decode_only and reqs == batch]
    if not full:
        return {"batch": batch, "steps": 0}
    mean_ms = statistics.fmean(sec for sec, _ in full) * 1e3
    floor_ms = statistics.fmean((weight_bytes + kv * kv_per_token) / HBM_BYTES_PER_S for _, kv in full) * 1e3
    return {
        "batch": batch,
        "steps": len(full),
        "mean_step_ms": round(mean_ms, 3),
        "median_step_ms": round(statistics.median(sec for sec, _ in full) * 1e3, 3),
        "mean_floor_ms": round(floor_ms, 6),
        "ratio_to_floor": round(mean_ms / floor_ms, 2),
        "mean_context_tokens": round(statistics.fmean(kv for _, kv in full) / batch, 1),
    }
