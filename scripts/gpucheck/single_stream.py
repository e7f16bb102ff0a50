"""Part: single-stream decode step time next to the weight-read floor (Qwen3-0.6B shape; Llama-3.1-8B
shape when the parent gives it time).

A step is one `engine.step()` of one request decoding after a 128-token prompt (scheduler, forward
pass, sampling, the copy of the token to the host, detokenizing): the time per output token a
client sees. Its floors: the bytes of the weight matrices a step reads (every layer's projections
and the LM head, not the embedding table) plus the context's K/V, at 4.8 TB/s (`floor_ms`; the
issue's 8B floor, 16.06 GB / 4.8 TB/s = 3.35 ms, counts the embedding table too:
`floor_ms_all_weights`); and, measured, one batch-1 matrix-vector pass over the same matrices
(replayed as a CUDA graph, so it is not launch-bound).
"""

from __future__ import annotations

import random
import shutil
import statistics
import time

import torch
import torch.nn.functional as F

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
    synchronize,
    weight_read_bytes,
    with_torch_fallback,
)
from gpucheck.results import read_json

TARGET_STEP_MS = {"qwen3-0.6b": 1.5, "llama-3.1-8b": 4.2}  # the targets on an H200
PROMPT_LEN = 128
MODEL_KEYS = ("weight_read_bytes", "all_weight_bytes", "floor_ms", "floor_ms_all_weights", "matvec_pass_ms", "backend")


def run(ctx: PartContext) -> None:
    result = ctx.result
    if ctx.options.get("merge"):  # the 8B run adds to the 0.6B one's file
        result.update(read_json(ctx.path) or {})
    result.setdefault("models", {})
    result.update(hbm_bytes_per_s=HBM_BYTES_PER_S, prompt_len=PROMPT_LEN)
    modes = cuda_graph_modes()
    result["cuda_graphs"] = (
        "absent (the engine takes no enforce_eager yet): eager only" if len(modes) == 1 else "measured"
    )
    if ctx.on_cuda and "copy_bandwidth_tb_s" not in result:
        result["copy_bandwidth_tb_s"] = copy_bandwidth_tb_s(ctx.device)
    for name in ctx.options.get("models", ["qwen3-0.6b"]):
        try:
            result["models"][name] = measure_model(ctx, name, modes)
        except Exception as exc:  # noqa: BLE001 - recorded, the next model goes on
            result["models"][name] = error_record(exc)
        ctx.save()
    statuses = [m.get("status") for m in result["models"].values()]
    result["status"] = "ok" if all(s in ("ok", "skipped") for s in statuses) else "partial"


def measure_model(ctx: PartContext, name: str, modes: list[tuple[str, dict]]) -> dict:
    steps = 8 if ctx.quick else 64
    started = time.perf_counter()
    model_dir = ensure_checkpoint(ctx.work_dir, name, ctx.quick, ctx.device)
    record: dict = {
        "checkpoint_s": round(time.perf_counter() - started, 1),
        "steps_timed": steps,
        "target_step_ms": None if ctx.quick else TARGET_STEP_MS.get(name),
        "modes": {},
    }
    backend = ctx.options.get("throughput_backend") or "auto"
    base = dict(
        dtype="bfloat16",
        device=ctx.device.type,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        max_model_len=1024,
        kv_cache_memory="16MiB" if ctx.quick else "1GiB",
        attention_backend=backend,
        block_size=speed_block_size(backend, ctx.device),
    )
    try:
        for label, extra in modes:
            mode = with_torch_fallback(
                lambda s: measure_settings(model_dir, s, ctx.device, steps), {**base, **extra}, ctx, min_left_s=20
            )
            for key in MODEL_KEYS:  # the same in every mode: kept once, on the model
                if key in mode:
                    record[key] = mode.pop(key)
            record["modes"][label] = mode
    finally:
        if name == "llama-3.1-8b" and not ctx.quick:
            shutil.rmtree(model_dir, ignore_errors=True)  # 16 GB of disk
    timed = {label: m for label, m in record["modes"].items() if "median_step_ms" in m}
    if not timed:
        record["status"] = "error"
        return record
    if "eager" in timed and "cuda_graphs" in timed:
        record["graphs_speedup"] = round(timed["eager"]["median_step_ms"] / timed["cuda_graphs"]["median_step_ms"], 2)
    best = min(m["median_step_ms"] for m in timed.values())
    record.update(
        status="ok",
        best_step_ms=best,
        ratio_to_floor=round(best / record["floor_ms"], 2),
        weight_bandwidth_fraction=round(record["floor_ms"] / best, 3),
    )
    if record["target_step_ms"] is not None:
        record["meets_target"] = best <= record["target_step_ms"]
    logger.info(
        "single stream %s: step %.3f ms (%s), floor %.4g ms, matvec pass %s ms",
        name,
        best,
        ", ".join(f"{k} {v['median_step_ms']}" for k, v in timed.items()),
        record["floor_ms"],
        record.get("matvec_pass_ms"),
    )
    return record


def measure_settings(model_dir, settings: dict, device: torch.device, steps: int) -> dict:
    llm = build_llm(model_dir, **settings)
    try:
        return measure_engine(llm, device, steps)
    finally:
        shutdown(llm)
        del llm
        free_memory()


def measure_engine(llm, device: torch.device, steps: int) -> dict:
    from engine import SamplingParams

    engine = llm.engine
    rng = random.Random(0)
    prompt = [rng.randrange(0, min(10000, engine.vocab_size)) for _ in range(PROMPT_LEN)]
    warmup = 8
    engine.add_request("single", prompt, SamplingParams(max_tokens=steps + warmup + 4, temperature=0, ignore_eos=True))
    engine.step()  # the prefill
    for _ in range(warmup):
        engine.step()
    timings = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        timings.append((time.perf_counter() - start) * 1e3)
    engine.abort(["single"])
    while engine.has_work:
        engine.step()
    record = {
        "median_step_ms": round(statistics.median(timings), 4),
        "mean_step_ms": round(statistics.fmean(timings), 4),
        "p90_step_ms": round(sorted(timings)[int(0.9 * (len(timings) - 1))], 4),
        "backend": engine.runner.backend.name,
    }
    model = engine.runner.model
    weights = weight_read_bytes(model)
    kv = (PROMPT_LEN + warmup + steps // 2) * kv_bytes_per_token(engine.runner.kv_cache.spec)
    untied_embedding = 0 if model.arch.tie_word_embeddings else model.embed.numel() * model.embed.element_size()
    record.update(
        weight_read_bytes=weights,
        floor_ms=round((weights + kv) / HBM_BYTES_PER_S * 1e3, 6),
        all_weight_bytes=weights + untied_embedding,
        floor_ms_all_weights=round((weights + untied_embedding) / HBM_BYTES_PER_S * 1e3, 6),
        matvec_pass_ms=matvec_pass_ms(model.weight_tensors(), device, model.dtype),
    )
    return record


def matvec_pass_ms(weights, device: torch.device, dtype: torch.dtype, repeats: int = 20) -> dict:
    """One batch-1 F.linear per weight matrix: median ms, eager and (CUDA) replayed as one graph."""
    from engine.bench import _plain

    mats = [w if isinstance(w, torch.Tensor) and w.layout == torch.strided else _plain(w, dtype) for w in weights]
    inputs = [torch.randn(1, w.shape[1], dtype=w.dtype, device=device) for w in mats]

    def one_pass():
        for x, w in zip(inputs, mats):
            F.linear(x, w)

    with torch.inference_mode():
        out = {"eager": round(_median_ms(one_pass, device, repeats), 4)}
        if device.type == "cuda":
            try:
                side = torch.cuda.Stream(device)  # warm up on a side stream before capturing (torch's recipe)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(3):
                        one_pass()
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    one_pass()
                out["graph"] = round(_median_ms(graph.replay, device, repeats), 4)
            except Exception as exc:  # noqa: BLE001 - the eager figure stands
                out["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    fn()
    synchronize(device)
    timings = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            timings.append(start.elapsed_time(end))
        else:
            start_s = time.perf_counter()
            fn()
            timings.append((time.perf_counter() - start_s) * 1e3)
    return statistics.median(timings)


def copy_bandwidth_tb_s(device: torch.device) -> float:
    """A 2 GiB device-to-device copy, bytes read plus written per second (KINDS.md saw ~4.3 TB/s)."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, 10)
    src = dst = None  # the 4 GiB go back before the next measurement
    free_memory()
    return round(2 * 2**31 / (ms * 1e-3) / 1e12, 2)
