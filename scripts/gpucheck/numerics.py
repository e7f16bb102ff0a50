"""Part: each GPU attention backend against the `torch` backend on random paged inputs, in bf16.

A case is one step built as the runner builds it (decodes first, then prefill chunks, one int32
block table over shuffled, non-contiguous blocks, `slot_mapping` for the new tokens), over a cache
full of large garbage except each request's cached prefix. Every backend gets its own copy of the
cache, writes the step's K/V and attends; its output is compared with the torch backend's on the
same inputs (the target: max abs error < 2e-2) and, for scale, with the torch backend in float32.

`flash` stands for each installed flash-attn generation on its own ("flash-attn 4", "flash-attn 2"),
each at the block sizes it takes, chosen per head shape and block size as the engine chooses it
(the start-up probe of that configuration included: a probe that fails makes the case unsupported).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from gpucheck.common import (
    BF16_TARGET_MAX_ABS_ERR,
    FLASH_GENERATIONS,
    PartContext,
    distribution_versions,
    error_record,
    find_flash,
    flash_label,
    logger,
    synchronize,
)

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
        return StepInputs(
            cast(self.key_cache),
            cast(self.value_cache),
            cast(self.query),
            cast(self.key),
            cast(self.value),
            self.step,
            self.block_size,
        )


def case_shapes(kind: str, block_size: int, quick: bool, rng: random.Random) -> tuple[list[Shape], dict]:
    """(shapes, shared prefixes {seq: owner seq}) of a case: prefill, chunked_prefill, decode or mixed."""
    if kind == "prefill":
        lens = (1, 5, 16, 40) if quick else (1, 7, 16, 100, 256, 1000, 2048)
        return [(n, n, False) for n in lens], {}
    if kind == "chunked_prefill":  # chunks continuing a cached prefix; the last two share their prefix
        pairs = (
            ((20, 7), (33, 1), (50, 20), (50, 30))
            if quick
            else ((48, 16), (300, 45), (1000, 256), (640, 1), (2100, 512), (2100, 300))
        )
        return [(c, q, False) for c, q in pairs], {len(pairs) - 1: len(pairs) - 2}
    longest = 64 if quick else 4096
    edges = [1, block_size, block_size + 1, 3 * block_size, longest]
    if kind == "decode":
        count = 6 if quick else 64
        return [(n, 1, True) for n in [rng.randint(1, longest) for _ in range(count)] + edges], {}
    if kind == "mixed":
        decodes = [(rng.randint(1, longest // 2), 1, True) for _ in range(3 if quick else 16)]
        chunks = (
            ((30, 10, False), (9, 9, False), (1, 1, False))
            if quick
            else ((700, 200, False), (64, 1, False), (300, 300, False), (1, 1, False))
        )
        return decodes + list(chunks), {}
    raise ValueError(kind)


def build_inputs(
    shapes: list[Shape],
    shared: dict,
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    device: torch.device,
    seed: int,
) -> StepInputs:
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
        cache.view(-1, kv_heads, head_dim)[cached] = torch.randn(
            cached.numel(), kv_heads, head_dim, generator=gen, device=device
        )
    new = torch.cat([slots(i, c - q, c) for i, (c, q, _) in enumerate(shapes)])
    num_tokens = new.numel()
    num_decodes = sum(1 for _, _, is_decode in shapes if is_decode)
    step = step_metadata_for([(c, q, tables[i]) for i, (c, q, _) in enumerate(shapes)], new, num_decodes, device)
    randn = lambda *shape: torch.randn(shape, generator=gen, device=device)  # noqa: E731
    return StepInputs(
        key_cache,
        value_cache,
        randn(num_tokens, heads, head_dim),
        randn(num_tokens, kv_heads, head_dim),
        randn(num_tokens, kv_heads, head_dim),
        step,
        block_size,
    )


def build_metadata(backend, inputs: StepInputs):
    """The backend's metadata of the step (where a backend refuses a configuration, e.g. a block size)."""
    from engine.attention.kv_cache import KVCacheSpec

    _, block_size, kv_heads, head_dim = inputs.key_cache.shape
    return backend.build_metadata(inputs.step, KVCacheSpec(1, block_size, kv_heads, head_dim, inputs.key_cache.dtype))


def run_backend(
    backend, inputs: StepInputs, device: torch.device, metadata=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, key cache, value cache) after the backend wrote the step's K/V and attended."""
    key_cache, value_cache = inputs.key_cache.clone(), inputs.value_cache.clone()
    from engine.attention.layer_attention import LayerAttention

    head_dim = key_cache.shape[-1]
    metadata = build_metadata(backend, inputs) if metadata is None else metadata
    backend.write_kv(inputs.key, inputs.value, key_cache, value_cache, metadata)
    layer = LayerAttention(head_dim**-0.5)
    out = backend.attend(inputs.query, inputs.key, inputs.value, key_cache, value_cache, metadata, layer)
    synchronize(device)
    return out, key_cache, value_cache


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.float() - b.float()).abs()
    return float("nan") if bool(diff.isnan().any()) else float(diff.max())


def finite(x: float):
    """A JSON-safe number: non-finite values as strings."""
    return x if math.isfinite(x) else str(x)


class Candidates:
    """The backends under test by label, and how to get each for a block size and head shape. A flash
    generation is looked up per block size, and for each head shape the engine's start-up probe of
    that configuration is run too: its verdict is recorded beside the measurement, which is made
    either way (a kernel the probe turns away is measured all the same, to see how wrong it is)."""

    def __init__(self, names: list[str], device: torch.device, dtype: torch.dtype):
        from engine.attention import get_attention_backend

        self.device, self.dtype = device, dtype
        self.plain: dict[str, object] = {}
        self.flash: dict[str, int] = {}  # label -> generation
        self.availability: dict[str, dict] = {}
        self._found: dict[tuple, tuple] = {}
        for name in names:
            if name == "flash":
                for generation, block_sizes in FLASH_GENERATIONS.items():
                    label = flash_label(generation)
                    backend, why = self._find(generation, block_sizes[0])
                    self._record(label, backend is not None, why, block_sizes=list(block_sizes))
                    if backend is not None:
                        self.flash[label] = generation
                continue
            try:
                self.plain[name] = get_attention_backend(name, device, dtype)
                self._record(name, True, self.plain[name].name)
            except Exception as exc:  # noqa: BLE001 - any failure means unavailable, with its reason
                self._record(name, False, f"{type(exc).__name__}: {exc}")

    def _record(self, label: str, ok: bool, reason: str, **extra) -> None:
        self.availability[label] = {"available": ok, ("found" if ok else "reason"): reason, **extra}
        logger.info("backend %s: %s", label, "available" if ok else f"unavailable ({reason})")

    def _find(self, generation: int, block_size: int, shape=None) -> tuple:
        """find_flash, once per configuration (a failure of the search itself is its reason)."""
        key = (generation, block_size, shape)
        if key not in self._found:
            try:
                self._found[key] = find_flash(generation, self.device, self.dtype, block_size, shape)
            except Exception as exc:  # noqa: BLE001 - recorded as the reason
                self._found[key] = (None, f"{type(exc).__name__}: {exc}")
        return self._found[key]

    @property
    def labels(self) -> list[str]:
        return [*self.plain, *self.flash]

    def takes(self, label: str, block_size: int) -> bool:
        return label in self.plain or block_size in FLASH_GENERATIONS[self.flash[label]]

    def get(self, label: str, block_size: int, heads: int, kv_heads: int, head_dim: int) -> tuple[object, dict]:
        """(backend or None, notes for the case: why none, or the probe's verdict on this configuration)."""
        if label in self.plain:
            return self.plain[label], {}
        from engine.attention.attention_shape import AttentionShape

        generation = self.flash[label]
        backend, why = self._find(generation, block_size)
        if backend is None:
            return None, {"reason": why[:500]}
        probed, verdict = self._find(generation, block_size, AttentionShape(heads, kv_heads, head_dim))
        return backend, {"probe": "passed" if probed is not None else verdict[-500:]}


def run(ctx: PartContext) -> None:
    from engine.attention import get_attention_backend

    device = ctx.device
    dtype = torch.bfloat16
    names = list(ctx.options.get("backends") or CANDIDATES)
    if device.type == "cpu" and "cpu" not in names:
        names.append("cpu")  # the native CPU kernels stand in for a GPU backend on CPU (--device cpu)
    result = ctx.result
    result.update(
        dtype="bfloat16",
        target_max_abs_err=BF16_TARGET_MAX_ABS_ERR,
        cases=[],
        flash_versions=distribution_versions(("flash-attn", "flash-attn-4")),
    )
    candidates = Candidates(names, device, dtype)
    result["backends"] = candidates.availability
    ctx.save()
    if not candidates.labels:
        result["status"] = "skipped"
        result["reason"] = "no GPU attention backend is available here"
        return
    reference = get_attention_backend("torch", device, dtype)
    head_configs = [(4, 2, 16), (4, 4, 64)] if ctx.quick else [(16, 8, 128), (32, 8, 128), (14, 2, 64)]
    block_sizes = (16,) if ctx.quick else (16, 256)
    kinds = ("prefill", "chunked_prefill", "decode", "mixed")
    skipped = 0
    # Head shapes outermost: when time runs out, every backend and block size has its first shapes measured.
    for heads, kv_heads, head_dim in head_configs:
        for block_size in block_sizes:
            labels = [label for label in candidates.labels if candidates.takes(label, block_size)]
            for kind in kinds:
                if not ctx.has_time(5):
                    skipped += len(labels)
                    continue
                seed = len(result["cases"]) + 1
                shapes, shared = case_shapes(kind, block_size, ctx.quick, random.Random(seed))
                inputs = build_inputs(shapes, shared, block_size, heads, kv_heads, head_dim, device, seed)
                bf16 = inputs.to(dtype)
                ref_out, ref_k, ref_v = run_backend(reference, bf16, device)
                fp32_out, _, _ = run_backend(reference, bf16.to(torch.float32), device)
                base = dict(
                    block_size=block_size,
                    heads=heads,
                    kv_heads=kv_heads,
                    head_dim=head_dim,
                    case=kind,
                    num_reqs=len(shapes),
                    num_tokens=int(inputs.query.shape[0]),
                    torch_max_abs_err_vs_fp32=finite(max_abs(ref_out, fp32_out)),
                )
                for label in labels:
                    backend, notes = candidates.get(label, block_size, heads, kv_heads, head_dim)
                    if backend is None:
                        result["cases"].append(dict(backend=label, **base, status="unsupported", **notes))
                        continue
                    record = compare(label, backend, bf16, device, base, ref_out, ref_k, ref_v, fp32_out)
                    result["cases"].append({**record, **notes})
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
        status="ok",
        max_abs_err=finite(err),
        max_abs_err_vs_fp32=finite(max_abs(out, fp32_out)),
        kv_write_max_abs_err=finite(max(max_abs(key_cache, ref_k), max_abs(value_cache, ref_v))),
        passed=err < BF16_TARGET_MAX_ABS_ERR,
        seconds=round(time.perf_counter() - started, 3),
    )
    logger.info(
        "numerics %-6s %-15s bs=%-3d heads=%d/%d hd=%-3d tokens=%-5d max abs err %.2e (torch bf16 vs fp32: %s)",
        name,
        base["case"],
        base["block_size"],
        base["heads"],
        base["kv_heads"],
        base["head_dim"],
        base["num_tokens"],
        err,
        base["torch_max_abs_err_vs_fp32"],
    )
    return record


def summarize(result: dict, skipped: int) -> None:
    """Per backend: the largest error over its measured cases, and whether every one met the target
    (None when a backend refused every case: nothing was measured)."""
    per_backend: dict[str, dict] = {}
    for case in result["cases"]:
        entry = per_backend.setdefault(
            case["backend"], {"cases": 0, "errors": 0, "unsupported": 0, "probe_failed": 0, "_errs": []}
        )
        entry["cases"] += 1
        if case.get("probe", "passed") != "passed":  # the engine would not pick this kernel here
            entry["probe_failed"] += 1
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
        entry.update(
            max_abs_err=finite(worst) if errs else None, passed=not entry["errors"] and worst < BF16_TARGET_MAX_ABS_ERR
        )
    result["summary"] = per_backend
    result["cases_skipped_for_time"] = skipped
    measured = [e["passed"] for e in per_backend.values() if e["passed"] is not None]
    result["passed"] = all(measured) if measured else None
    result["status"] = "ok" if not skipped else "partial"
    for name, entry in per_backend.items():
        logger.info(
            "numerics %s: max abs err %s over %d cases (%d errors, %d unsupported, %d failed the engine's probe) -> %s",
            name,
            entry["max_abs_err"],
            entry["cases"],
            entry["errors"],
            entry["unsupported"],
            entry["probe_failed"],
            {True: "PASS", False: "FAIL", None: "not measured"}[entry["passed"]],
        )
