"""Part: greedy tokens of the tiny random models, every backend on the device vs the CPU engine in fp32.

The reference is the `torch` backend on CPU in float32, itself compared with HF transformers' greedy
tokens (float32, CPU) on the same prompts. Each available backend on the device (`torch` too, as
the baseline) runs in bfloat16 and float32 (where it takes them) with the same engine settings
(chunked prefill: 64-token steps; prefix caching on) and prompts; per prompt we record how many
leading tokens agree with the reference, and (for the other backends) with the `torch` backend on
the device in the same dtype. bf16 drifts by nature (on these random models even the torch
backend's bf16 tokens can leave the fp32 ones at the first token): identical tokens are expected
in float32; in bfloat16 the same-dtype comparison is the one that shows a kernel's error.

`flash` runs at blocks of 16 and of 256 (each run records the kernel it got: flash-attn 4 takes
both, flash-attn 2 only 256). Where a bfloat16 run replayed its decode steps from CUDA graphs, the
same run again with `enforce_eager` must give the same tokens (`graphs_match_eager`).
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from gpucheck.common import PartContext, backend_available, build_llm, error_record, free_memory, logger, shutdown

CANDIDATES = ("torch", "triton", "flash")
DTYPES = ("bfloat16", "float32")
ENGINE = dict(
    max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, kv_cache_memory="64MiB", enable_prefix_caching=True
)


def tiny_models(quick: bool) -> dict[str, tuple[str, dict]]:
    """name -> (architecture, overrides of tests/engine/factories.py's tiny config)."""
    models = {"tiny-llama": ("llama", {})}  # head_dim 16
    if not quick:
        models["tiny-qwen3-hd64"] = (
            "qwen3",
            {
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
            },
        )
    return models


def make_prompts(quick: bool) -> list[list[int]]:
    """Token-id prompts (vocab 512), short to chunked; the last two share a 48-token prefix."""
    rng = random.Random(0)
    lens = (3, 70) if quick else (3, 17, 40, 70, 100, 150)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lens]
    prefix = [rng.randrange(3, 512) for _ in range(48)]
    return prompts + [prefix + [7, 8, 9], prefix + [rng.randrange(3, 512) for _ in range(30)]]


def generate(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in results]


def reference_tokens(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    llm = build_llm(model_dir, **ENGINE, device="cpu", dtype="float32", attention_backend="torch")
    try:
        return generate(llm, prompts, max_tokens)
    finally:
        shutdown(llm)
        del llm
        free_memory()


def hf_agreement(model_dir: Path, prompts: list[list[int]], max_tokens: int, reference: list[list[int]]) -> dict:
    """The reference's matching prefix per prompt against HF transformers' greedy tokens (fp32, CPU)."""
    from tests.engine.references import hf_greedy, hf_model

    try:
        hf = [hf_greedy(model_dir, prompt, max_tokens)[0] for prompt in prompts]
    except Exception as exc:  # noqa: BLE001 - recorded; the device comparisons go on
        return error_record(exc)
    finally:
        hf_model.cache_clear()
    matches = [matching_prefix(t, r) for t, r in zip(reference, hf)]
    logger.info(
        "greedy reference vs HF transformers (fp32, CPU) %s: matching prefix per prompt %s of %d",
        model_dir.name,
        matches,
        max_tokens,
    )
    return {"status": "ok", "matching_prefix": matches, "all_match": all(m == max_tokens for m in matches)}


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def planned_runs(candidates: list[str], device: torch.device) -> tuple[dict, list[tuple[str, str, tuple]]]:
    """({backend: availability}, [(backend, dtype, block sizes to try in order)]): flash once per block
    size it may take, the others at 16 (256 if they refuse 16)."""
    available, runs = {}, []
    for name in candidates:
        found = {}
        for block_sizes in ((16,), (256,)) if name == "flash" else ((16, 256),):
            ok, found[f"block {block_sizes[0]}"] = backend_available(name, device, torch.bfloat16, block_sizes[0])
            if ok:
                runs += [(name, dtype, block_sizes) for dtype in DTYPES]
        ok = any(backend == name for backend, _, _ in runs)
        why = found if name == "flash" else found["block 16"]
        available[name] = {"available": ok, ("found" if ok else "reason"): why}
    runs.sort(key=lambda run: run[0] != "torch")  # torch first: the same-dtype reference
    return available, runs


def run(ctx: PartContext) -> None:
    from tests.engine.factories import make_tiny_model_dir

    device = ctx.device
    candidates = list(ctx.options.get("backends") or CANDIDATES)
    if device.type == "cpu" and "cpu" not in candidates:
        candidates.append("cpu")
    max_tokens = 12 if ctx.quick else 48
    prompts = make_prompts(ctx.quick)
    result = ctx.result
    result.update(
        reference={"device": "cpu", "dtype": "float32", "backend": "torch"},
        device=str(device),
        max_tokens=max_tokens,
        engine=ENGINE,
        prompt_lens=[len(p) for p in prompts],
        models={},
    )
    result["backends"], runs = planned_runs(candidates, device)
    all_match_fp32 = True
    with tempfile.TemporaryDirectory(prefix="tiny-", dir=ctx.work_dir) as tmp:  # the check removes it if killed
        for model_name, (arch, overrides) in tiny_models(ctx.quick).items():
            model_dir = make_tiny_model_dir(Path(tmp) / model_name, arch, **overrides)
            entry = result["models"][model_name] = {"arch": arch, "overrides": overrides, "runs": []}
            reference = reference_tokens(model_dir, prompts, max_tokens)
            entry["reference_vs_hf"] = hf_agreement(model_dir, prompts, max_tokens, reference)
            ctx.save()
            torch_tokens = {}  # dtype -> the torch backend's tokens on the device: a same-dtype reference
            for name, dtype, block_sizes in runs:
                if not ctx.has_time(5):
                    entry["runs"].append({"backend": name, "dtype": dtype, "status": "skipped", "reason": "time"})
                    continue
                record, tokens = run_one(model_dir, prompts, max_tokens, reference, name, dtype, device, block_sizes)
                if name == "torch" and tokens is not None:
                    torch_tokens[dtype] = tokens
                elif tokens is not None and dtype in torch_tokens:
                    record["matching_prefix_vs_device_torch"] = [
                        matching_prefix(t, r) for t, r in zip(tokens, torch_tokens[dtype])
                    ]
                replayed = tokens is not None and record.get("cuda_graphs", "off") != "off"
                if replayed and dtype == "bfloat16" and ctx.has_time(5):  # serving's dtype: one rerun each
                    compare_with_eager(record, tokens, model_dir, prompts, max_tokens, name, dtype, device)
                entry["runs"].append(record)
                if dtype == "float32" and record.get("status") == "ok":
                    all_match_fp32 = all_match_fp32 and record["all_match"]
                ctx.save()
    result["all_match_float32"] = all_match_fp32
    result["reference_matches_hf"] = all(m["reference_vs_hf"].get("all_match") for m in result["models"].values())
    graphs = [
        r["graphs_match_eager"] for m in result["models"].values() for r in m["runs"] if "graphs_match_eager" in r
    ]
    result["graphs_match_eager"] = all(graphs) if graphs else None  # None: no run replayed graphs here
    statuses = [r.get("status") for m in result["models"].values() for r in m["runs"]]
    result["status"] = "ok" if all(s in ("ok", "unsupported") for s in statuses) else "partial"


def compare_with_eager(
    record: dict,
    tokens: list[list[int]],
    model_dir: Path,
    prompts,
    max_tokens: int,
    name: str,
    dtype: str,
    device: torch.device,
) -> None:
    """The same run with enforce_eager: its tokens against the graph run's."""
    eager, eager_tokens = run_one(
        model_dir, prompts, max_tokens, tokens, name, dtype, device, (record["block_size"],), enforce_eager=True
    )
    if eager_tokens is None:
        record["eager_run"] = eager
        return
    record["matching_prefix_vs_eager"] = eager["matching_prefix"]
    record["graphs_match_eager"] = eager["all_match"]
    logger.info(
        "greedy %s %-8s %s: graphs vs eager, matching prefix per prompt %s",
        name,
        dtype,
        model_dir.name,
        eager["matching_prefix"],
    )


def run_one(
    model_dir: Path,
    prompts,
    max_tokens: int,
    reference: list[list[int]],
    name: str,
    dtype: str,
    device: torch.device,
    block_sizes: tuple[int, ...],
    **settings,
) -> tuple[dict, Optional[list[list[int]]]]:
    """One backend and dtype: build with the first block size it takes, and compare. A backend that refuses
    to build in this dtype is "unsupported"; one that fails to generate, "error"."""
    record: dict = {"backend": name, "dtype": dtype, "device": str(device), **settings}
    started = time.perf_counter()
    refusals = []
    for block_size in block_sizes:
        try:
            llm = build_llm(
                model_dir,
                **ENGINE,
                device=device.type,
                dtype=dtype,
                attention_backend=name,
                block_size=block_size,
                **settings,
            )
        except Exception as exc:  # noqa: BLE001 - recorded; the next block size goes on
            refusals.append(f"block_size {block_size}: {type(exc).__name__}: {exc}"[:500])
            logger.info("greedy %s %s: no engine with block_size %d: %s", name, dtype, block_size, exc)
            continue
        record["kernel"] = llm.engine.runner.backend.name  # flash: which generation served this block size
        record["cuda_graphs"] = llm.engine.runner.cuda_graphs  # on CUDA, decodes replay graphs by default
        try:
            tokens = generate(llm, prompts, max_tokens)
        except Exception as exc:  # noqa: BLE001 - recorded, the next run goes on
            record.update(error_record(exc), block_size=block_size)
            return record, None
        finally:
            shutdown(llm)
            del llm
            free_memory()
        matches = [matching_prefix(t, r) for t, r in zip(tokens, reference)]
        record.update(
            status="ok",
            block_size=block_size,
            matching_prefix=matches,
            num_tokens=max_tokens,
            all_match=all(m == max_tokens for m in matches),
            seconds=round(time.perf_counter() - started, 2),
        )
        if refusals:
            record["refused"] = refusals
        logger.info(
            "greedy %s %-8s %s block %d: matching prefix per prompt %s of %d",
            record["kernel"],
            dtype,
            model_dir.name,
            block_size,
            matches,
            max_tokens,
        )
        return record, tokens
    record.update(status="unsupported", refused=refusals)
    return record, None
