"""The headline figures of the parts' JSON, each next to the issue's target (met: None off the H200)."""

from __future__ import annotations

from typing import Any, Optional

TARGETS = {
    "numerics_max_abs_err_bf16": "< 2e-2 vs the torch backend",
    "throughput_output_tok_s": ">= 25000 with CUDA graphs (nano-vllm workload, Qwen3-0.6B shape)",
    "single_stream_qwen3-0.6b_step_ms": "<= 1.5",
    "single_stream_llama-3.1-8b_step_ms": "<= 4.2 (floor 16.06 GB / 4.8 TB/s = 3.35 ms)",
    "graphs_speedup_batch1_qwen3-0.6b": ">= 1.5",
}


def headline(results: dict[str, dict], on_gpu: bool) -> dict[str, Any]:
    def met(ok: Optional[bool]) -> Optional[bool]:
        return ok if on_gpu else None

    tests, numerics, greedy, throughput, single = (
        results[k] for k in ("tests_gpu", "numerics", "greedy", "throughput", "single_stream")
    )
    out: dict[str, Any] = {}
    out["tests_gpu"] = {
        "status": tests.get("status"),
        "counts": tests.get("counts"),
        "failures": test_failures(tests.get("tests") or {}),
    }
    if tests.get("running"):
        out["tests_gpu"]["running_when_it_ended"] = tests["running"]
    per_backend = numerics.get("summary") or {}
    out["numerics_max_abs_err_bf16"] = {
        "target": TARGETS["numerics_max_abs_err_bf16"],
        "status": numerics.get("status"),
        "value": {name: entry["max_abs_err"] for name, entry in per_backend.items()} or None,
        "cases": {
            name: {k: entry.get(k) for k in ("cases", "errors", "unsupported", "probe_failed")}
            for name, entry in per_backend.items()
        }
        or None,
        "met": met(numerics.get("passed")) if per_backend else None,
    }
    out["greedy"] = {
        "status": greedy.get("status"),
        "all_match_float32": greedy.get("all_match_float32"),
        "reference_matches_hf": greedy.get("reference_matches_hf"),
        "graphs_match_eager": greedy.get("graphs_match_eager"),
        "min_matching_prefix": greedy_prefixes(greedy),
    }
    runs = throughput.get("runs") or {}
    graphs = runs.get("cuda_graphs", {}).get("output_tok_s")
    out["throughput_output_tok_s"] = {
        "target": TARGETS["throughput_output_tok_s"],
        "status": throughput.get("status"),
        "eager": runs.get("eager", {}).get("output_tok_s"),
        "eager_completed": runs.get("eager", {}).get("completed"),
        "cuda_graphs": graphs if graphs is not None else throughput.get("cuda_graphs"),
        "backend": next((r.get("backend") for r in runs.values() if r.get("backend")), None),
        "met": met(graphs >= 25000) if graphs is not None else None,
    }
    full = runs.get("eager", {}).get("full_batch_decode") or {}
    out["full_batch_decode_step_ms"] = {
        k: full.get(k) for k in ("batch", "steps", "mean_step_ms", "mean_floor_ms", "ratio_to_floor")
    }
    models = single.get("models") or {}
    for name in ("qwen3-0.6b", "llama-3.1-8b"):
        model = models.get(name, {})
        key = f"single_stream_{name}_step_ms"
        value = model.get("best_step_ms")
        out[key] = {
            "target": TARGETS[key],
            "status": model.get("status") or single.get("status"),
            "value": value,
            "floor_ms": model.get("floor_ms"),
            "ratio_to_floor": model.get("ratio_to_floor"),
            "met": met(model.get("meets_target")) if value is not None else None,
        }
        if model.get("reason"):
            out[key]["reason"] = model["reason"]
    speedup = models.get("qwen3-0.6b", {}).get("graphs_speedup")
    out["graphs_speedup_batch1_qwen3-0.6b"] = {
        "target": TARGETS["graphs_speedup_batch1_qwen3-0.6b"],
        "value": speedup if speedup is not None else single.get("cuda_graphs"),
        "met": met(speedup >= 1.5) if speedup is not None else None,
    }
    return out


def greedy_prefixes(greedy: dict) -> dict[str, str]:
    """'model backend dtype' -> 'least matching prefix over the prompts / tokens' (or the run's status)."""
    out = {}
    for model, entry in (greedy.get("models") or {}).items():
        for run in entry.get("runs", []):
            key = f"{model} {run.get('kernel') or run.get('backend')} {run.get('dtype')}"
            if run.get("block_size") is not None:
                key += f" block {run['block_size']}"
            if run.get("status") == "ok":
                out[key] = f"{min(run['matching_prefix'])}/{run['num_tokens']}"
                if run.get("matching_prefix_vs_device_torch"):
                    out[key] += f" (vs torch on the device: {min(run['matching_prefix_vs_device_torch'])})"
            else:
                out[key] = run.get("status", "?")
    return out


def test_failures(tests: dict[str, dict]) -> dict[str, str]:
    """'node id' -> 'outcome: the failure's last line' for each test that failed, errored or xpassed."""
    out = {}
    for node, entry in tests.items():
        if entry.get("outcome") in ("failed", "error", "xpassed"):
            lines = (entry.get("failure") or "").strip().splitlines()
            out[node] = f"{entry['outcome']}: {lines[-1][:300]}" if lines else entry["outcome"]
    return out
