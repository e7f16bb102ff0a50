"""Part 2: greedy tokens of the tiny random models, every backend on the device vs the CPU engine in fp32.

The reference is the `torch` backend on CPU in float32. Each available backend on the device
(`torch` too, as the baseline) runs in bfloat16 and float32 (where it takes them) with the same
engine settings (chunked prefill: 64-token steps; prefix caching on) and prompts; per prompt we
record how many leading tokens agree with the reference, and (for the other backends) with the
`torch` backend on the device in the same dtype. bf16 drifts by nature (on these random models even
the torch backend's bf16 tokens can leave the fp32 ones at the first token): identical tokens are
expected in float32; in bfloat16 the same-dtype comparison is the one that shows a kernel's error.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from gpucheck.common import PartContext, backend_available, build_llm, error_record, free_memory, logger

CANDIDATES = ("torch", "triton", "flash")
DTYPES = ("bfloat16", "float32")
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, kv_cache_memory="64MiB",
              enable_prefix_caching=True)


def tiny_models(quick: bool) -> dict[str, tuple[str, dict]]:
    """name -> (architecture, overrides of tests/engine/factories.py's tiny config)."""
    models = {"tiny-llama": ("llama", {})}  # head_dim 16
    if not quick:
        models["tiny-qwen3-hd64"] = ("qwen3", {"hidden_size": 256, "intermediate_size": 512,
                                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64})
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
        del llm
        free_memory()


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(ctx: PartContext) -> None:
    from tests.engine.factories import make_tiny_model_dir

    device = ctx.device
    candidates = list(ctx.options.get("backends") or CANDIDATES)
    if device.type == "cpu" and "cpu" not in candidates:
        candidates.append("cpu")
    candidates.sort(key=lambda name: name != "torch")  # torch first: the same-dtype reference
    max_tokens = 12 if ctx.quick else 48
    prompts = make_prompts(ctx.quick)
    result = ctx.result
    result.update(reference={"device": "cpu", "dtype": "float32", "backend": "torch"}, device=str(device),
                  max_tokens=max_tokens, engine=ENGINE, prompt_lens=[len(p) for p in prompts], models={})
    available = {}
    for name in candidates:
        ok, reason = backend_available(name, device, torch.bfloat16)
        available[name] = {"available": ok, **({} if ok else {"reason": reason})}
    result["backends"] = available
    runs = [(name, dtype) for name in candidates if available[name]["available"] for dtype in DTYPES]
    all_match_fp32 = True
    with tempfile.TemporaryDirectory(prefix="gpu-check-tiny-") as tmp:
        for model_name, (arch, overrides) in tiny_models(ctx.quick).items():
            model_dir = make_tiny_model_dir(Path(tmp) / model_name, arch, **overrides)
            entry = result["models"][model_name] = {"arch": arch, "overrides": overrides, "runs": []}
            reference = reference_tokens(model_dir, prompts, max_tokens)
            torch_tokens = {}  # dtype -> the torch backend's tokens on the device: a same-dtype reference
            for name, dtype in runs:
                if not ctx.has_time(5):
                    entry["runs"].append({"backend": name, "dtype": dtype, "status": "skipped", "reason": "time"})
                    continue
                record, tokens = run_one(model_dir, prompts, max_tokens, reference, name, dtype, device)
                if name == "torch" and tokens is not None:
                    torch_tokens[dtype] = tokens
                elif tokens is not None and dtype in torch_tokens:
                    record["matching_prefix_vs_device_torch"] = [
                        matching_prefix(t, r) for t, r in zip(tokens, torch_tokens[dtype])]
                entry["runs"].append(record)
                if dtype == "float32" and record.get("status") == "ok":
                    all_match_fp32 = all_match_fp32 and record["all_match"]
                ctx.save()
    result["all_match_float32"] = all_match_fp32
    statuses = [r.get("status") for m in result["models"].values() for r in m["runs"]]
    result["status"] = "ok" if all(s in ("ok", "unsupported") for s in statuses) else "partial"


def run_one(model_dir: Path, prompts, max_tokens: int, reference: list[list[int]], name: str, dtype: str,
            device: torch.device) -> tuple[dict, Optional[list[list[int]]]]:
    """One backend and dtype: build with blocks of 16, else of 256 (flash-attn 2 needs those), and compare.
    A backend that refuses to build in this dtype is "unsupported"; one that fails to generate, "error"."""
    record: dict = {"backend": name, "dtype": dtype, "device": str(device)}
    started = time.perf_counter()
    refusals = []
    for block_size in (16, 256):
        try:
            llm = build_llm(model_dir, **ENGINE, device=device.type, dtype=dtype, attention_backend=name,
                            block_size=block_size)
        except Exception as exc:  # noqa: BLE001 - recorded; the next block size goes on
            refusals.append(f"block_size {block_size}: {type(exc).__name__}: {exc}"[:500])
            logger.info("greedy %s %s: no engine with block_size %d: %s", name, dtype, block_size, exc)
            continue
        record["cuda_graphs"] = llm.engine.runner.cuda_graphs  # on CUDA, decodes replay graphs by default
        try:
            tokens = generate(llm, prompts, max_tokens)
        except Exception as exc:  # noqa: BLE001 - recorded, the next run goes on
            record.update(error_record(exc), block_size=block_size)
            return record, None
        finally:
            del llm
            free_memory()
        matches = [matching_prefix(t, r) for t, r in zip(tokens, reference)]
        record.update(status="ok", block_size=block_size, matching_prefix=matches, num_tokens=max_tokens,
                      all_match=all(m == max_tokens for m in matches),
                      seconds=round(time.perf_counter() - started, 2))
        if refusals:
            record["refused"] = refusals
        logger.info("greedy %s %-8s %s: matching prefix per prompt %s of %d", name, dtype, model_dir.name,
                    matches, max_tokens)
        return record, tokens
    record.update(status="unsupported", refused=refusals)
    return record, None
