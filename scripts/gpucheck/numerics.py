"""Part 1: each GPU attention backend against the `torch` backend on random paged inputs, in bf16.

A case is one step built as the runner builds it (decodes first, then prefill chunks, one int32
block table over shuffled, non-contiguous blocks, `slot_mapping` for the new tokens), over a cache
full of large garbage except each request's cached prefix. Every backend gets its own copy of the
cache, writes the step's K/V and attends; its output is compared with the torch backend's on the
same inputs (the target: max abs error < 2e-2) and, for scale, with the torch backend in float32.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from gpucheck.common import BF16_TARGET_MAX_ABS_ERR, PartContext, backend_available, error_record, logger, synchronize

CANDIDATES = ("triton", "flash")
Shape = tuple[int, int, bool]  # (context_len, query_len, is_decode)


@dataclass
class StepInputs:
    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor
    query: torch.Tensor  # [num_tokens, heads, head_dim]
    key: torch.Tensor  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor
    step: object  # StepMetadata
    block_size: int

    def to(self, dtype: torch.dtype) -> "StepInputs":
        cast = lambda t: t.to(dtype)  # noqa: E731
        return StepInputs(cast(self.key_cache), cast(self.value_cache), cast(self.query), cast(self.key),
                          cast(self.value), self.step, self.block_size)


def case_shapes(kind: str, block_size: int, quick: bool, rng: random.Random) -> tuple[list[Shape], dict]:
    """(shapes, shared prefixes {seq: owner seq}) of a case: prefill, chunked_prefill, decode or mixed."""
    if kind == "prefill":
        lens = (1, 5, 16, 40) if quick else (1, 7, 16, 100, 256, 1000, 2048)
        return [(n, n, False) for n in lens], {}
    if kind == "chunked_prefill":  # chunks continuing a cached prefix; the last two share their prefix
        pairs = ((20, 7), (33, 1), (50, 20), (50, 30)) if quick else (
            (48, 16), (300, 45), (1000, 256), (640, 1), (2100, 512), (2100, 300))
        return [(c, q, False) for c, q in pairs], {len(pairs) - 1: len(pairs) - 2}
    longest = 64 if quick else 4096
    edges = [1, block_size, block_size + 1, 3 * block_size, longest]
    if kind == "decode":
        count = 6 if quick else 64
        return [(n, 1, True) for n in [rng.randint(1, longest) for _ in range(count)] + edges], {}
    if kind == "mixed":
        decodes = [(rng.randint(1, longest // 2), 1, True) for _ in range(3 if quick else 16)]
        chunks = ((30, 10, False), (9, 9, False), (1, 1, False)) if quick else (
            (700, 200, False), (64, 1, False), (300, 300, False), (1, 1, False))
        return decodes + list(chunks), {}
    raise ValueError(kind)


def build_inputs(shapes: list[Shape], shared: dict, block_size: int, heads: int, kv_heads: int, head_dim: int,
                 device: torch.device, seed: int) -> StepInputs:
    """Random float32 inputs of one step (cast per backend run)."""
    from engine.attention.step_metadata import step_metadata_for

    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    counts = [-(-context // block_size) for context, _, _ in shapes]
    total = sum(counts) + 4
    free = list(range(total))
    rng.shuffle(free)
    tables: list[list[int]] = []
    for i, (context, query_len, _) in enumerate(shapes):
        table = []
        if i in shared:  # share every full block both cached prefixes cover
            owner = shared[i]
            prefix = min(context - query_len, shapes[owner][0] - shapes[owner][1])
            table = tables[owner][: prefix // block_size]
        tables.append(table + [free.pop() for _ in range(counts[i] - len(table))])

    def slots(i: int, start: int, stop: int) -> torch.Tensor:
        pos = torch.arange(start, stop)
        return torch.tensor(tables[i], dtype=torch.int64)[pos // block_size] * block_size + pos % block_size

    cache_shape = (total, block_size, kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen, device=device) * 10  # garbage outside the contexts
    value_cache = torch.randn(cache_shape, generator=gen, device=device) * 10
    cached = torch.cat([slots(i, 0, c - q) for i, (c, q, _) in enumerate(shapes)]).unique().to(device)
    for cache in (key_cache, value_cache):
        cache.view(-1, kv_heads, head_dim)[cached] = torch.randn(cached.numel(), kv_heads, head_dim, generator=gen,
                                                                 device=device)
    new = torch.cat([slots(i, c - q, c) for i, (c, q, _) in enumerate(shapes)])
    num_tokens = new.numel()
    num_decodes = sum(1 for _, _, is_decode in shapes if is_decode)
    step = step_metadata_for([(c, q, tables[i]) for i, (c, q, _) in enumerate(shapes)], new, num_decodes, device)
    randn = lambda *shape: torch.randn(shape, generator=gen, device=device)  # noqa: E731
    return StepInputs(key_cache, value_cache, randn(num_tokens, heads, head_dim), randn(num_tokens, kv_heads, head_dim),
                      randn(num_tokens, kv_heads, head_dim), step, block_size)


def build_metadata(backend, inputs: StepInputs):
    """The backend's metadata of the step (where a backend refuses a configuration, e.g. a block size)."""
    from engine.runner.kv_cache import KVCacheSpec

    _, block_size, kv_heads, head_dim = inputs.key_cache.shape
    return backend.build_metadata(inputs.step, KVCacheSpec(1, block_size, kv_heads, head_dim, inputs.key_cache.dtype))


def run_backend(backend, inputs: StepInputs, device: torch.device,
                metadata=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, key cache, value cache) after the backend wrote the step's K/V and attended."""
    key_cache, value_cache = inputs.key_cache.clone(), inputs.value_cache.clone()
    head_dim = key_cache.shape[-1]
    metadata = build_metadata(backend, inputs) if metadata is None else metadata
    backend.write_kv(inputs.key, inputs.value, key_cache, value_cache, metadata)
    out = backend.attend(inputs.query, inputs.key, inputs.value, key_cache, value_cache, metadata, head_dim**-0.5)
    synchronize(device)
    return out, key_cache, value_cache


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.float() - b.float()).abs()
    return float("nan") if bool(diff.isnan().any()) else float(diff.max())


def finite(x: float):
    """A JSON-safe number: non-finite values as strings."""
    return x if math.isfinite(x) else str(x)


def run(ctx: PartContext) -> None:
    from engine.attention import get_attention_backend

    device = ctx.device
    dtype = torch.bfloat16
    candidates = list(ctx.options.get("backends") or CANDIDATES)
    if device.type == "cpu" and "cpu" not in candidates:
        candidates.append("cpu")  # the native CPU kernels stand in for a GPU backend on CPU (--device cpu)
    result = ctx.result
    result.update(dtype="bfloat16", target_max_abs_err=BF16_TARGET_MAX_ABS_ERR, backends={}, cases=[])
    backends = {}
    for name in candidates:
        ok, reason = backend_available(name, device, dtype)
        result["backends"][name] = {"available": ok, **({} if ok else {"reason": reason})}
        if ok:
            backends[name] = get_attention_backend(name, device, dtype)
        logger.info("backend %s: %s", name, "available" if ok else f"unavailable ({reason})")
    ctx.save()
    if not backends:
        result["status"] = "skipped"
        result["reason"] = "no GPU attention backend is available here"
        return
    reference = get_attention_backend("torch", device, dtype)
    head_configs = [(4, 2, 16), (4, 4, 64)] if ctx.quick else [(16, 8, 128), (32, 8, 128), (14, 2, 64)]
    block_sizes = (16,) if ctx.quick else (16, 256)
    kinds = ("prefill", "chunked_prefill", "decode", "mixed")
    skipped = 0
    for block_size in block_sizes:
        for heads, kv_heads, head_dim in head_configs:
            for kind in kinds:
                if not ctx.has_time(5):
                    skipped += len(backends)
                    continue
                seed = len(result["cases"]) + 1
                shapes, shared = case_shapes(kind, block_size, ctx.quick, random.Random(seed))
                inputs = build_inputs(shapes, shared, block_size, heads, kv_heads, head_dim, device, seed)
                bf16 = inputs.to(dtype)
                ref_out, ref_k, ref_v = run_backend(reference, bf16, device)
                fp32_out, _, _ = run_backend(reference, bf16.to(torch.float32), device)
                base = dict(block_size=block_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim, case=kind,
                            num_reqs=len(shapes), num_tokens=int(inputs.query.shape[0]),
                            torch_max_abs_err_vs_fp32=finite(max_abs(ref_out, fp32_out)))
                for name, backend in backends.items():
                    result["cases"].append(compare(name, backend, bf16, device, base, ref_out, ref_k, ref_v, fp32_out))
                ctx.save()
    summarize(result, skipped)


def compare(name, backend, inputs: StepInputs, device, base: dict, ref_out, ref_k, ref_v, fp32_out) -> dict:
    record = dict(backend=name, **base)
    started = time.perf_counter()
    try:
        metadata = build_metadata(backend, inputs)
    except Exception as exc:  # noqa: BLE001 - the backend refuses this configuration: recorded, not failed
        record.update(status="unsupported", reason=f"{type(exc).__name__}: {exc}"[:500])
        return record
    try:
        out, key_cache, value_cache = run_backend(backend, inputs, device, metadata)
    except Exception as exc:  # noqa: BLE001 - recorded, the check goes on
        record.update(error_record(exc))
        return record
    err = max_abs(out, ref_out)
    record.update(
        status="ok", max_abs_err=finite(err), max_abs_err_vs_fp32=finite(max_abs(out, fp32_out)),
        kv_write_max_abs_err=finite(max(max_abs(key_cache, ref_k), max_abs(value_cache, ref_v))),
        passed=err < BF16_TARGET_MAX_ABS_ERR, seconds=round(time.perf_counter() - started, 3))
    logger.info("numerics %-6s %-15s bs=%-3d heads=%d/%d hd=%-3d tokens=%-5d max abs err %.2e (torch bf16 vs fp32: "
                "%s)", name, base["case"], base["block_size"], base["heads"], base["kv_heads"], base["head_dim"],
                base["num_tokens"], err, base["torch_max_abs_err_vs_fp32"])
    return record


def summarize(result: dict, skipped: int) -> None:
    """Per backend: the largest error over its measured cases, and whether every one met the target
    (None when a backend refused every case: nothing was measured)."""
    per_backend: dict[str, dict] = {}
    for case in result["cases"]:
        entry = per_backend.setdefault(case["backend"], {"cases": 0, "errors": 0, "unsupported": 0, "_errs": []})
        entry["cases"] += 1
        status = case.get("status")
        if status == "ok":
            err = case["max_abs_err"]
            entry["_errs"].append(float(err))  # "nan" / "inf" strings parse back
        elif status == "unsupported":
            entry["unsupported"] += 1
        else:
            entry["errors"] += 1
    for entry in per_backend.values():
        errs = entry.pop("_errs")
        if not errs and not entry["errors"]:
            entry.update(max_abs_err=None, passed=None)
            continue
        worst = float("nan") if any(math.isnan(e) for e in errs) else max(errs, default=float("nan"))
        entry.update(max_abs_err=finite(worst) if errs else None,
                     passed=not entry["errors"] and worst < BF16_TARGET_MAX_ABS_ERR)
    result["summary"] = per_backend
    result["cases_skipped_for_time"] = skipped
    measured = [e["passed"] for e in per_backend.values() if e["passed"] is not None]
    result["passed"] = all(measured) if measured else None
    result["status"] = "ok" if not skipped else "partial"
    for name, entry in per_backend.items():
        logger.info("numerics %s: max abs err %s over %d cases (%d errors, %d unsupported) -> %s", name,
                    entry["max_abs_err"], entry["cases"], entry["errors"], entry["unsupported"],
                    {True: "PASS", False: "FAIL", None: "not measured"}[entry["passed"]])
