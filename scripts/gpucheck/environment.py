"""Part 0: whether the engine imports and torch sees the device, versions, which attention backends load.

What it finds first (`engine_import`, `cuda_available`) tells the parent whether the other parts
can run at all; the rest is recorded best-effort.
"""

from __future__ import annotations

import importlib

import torch

from gpucheck.common import PartContext, backend_available, cuda_graph_modes, environment, logger

MODULES = ("pydantic", "yaml", "safetensors", "numpy", "tqdm", "jinja2", "transformers", "tokenizers", "triton")


def run(ctx: PartContext) -> None:
    result = ctx.result
    result["cuda_available"] = torch.cuda.is_available()
    try:
        import engine.llm  # noqa: F401 - every other part needs it

        result["engine_import"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the finding itself
        result["engine_import"] = f"{type(exc).__name__}: {exc}"
    ctx.save()
    try:
        result.update(environment(ctx.device))
    except Exception as exc:  # noqa: BLE001 - best-effort
        result["environment_error"] = f"{type(exc).__name__}: {exc}"
    result["modules"] = {}
    for module in MODULES:
        try:
            importlib.import_module(module)
            result["modules"][module] = "ok"
        except Exception as exc:  # noqa: BLE001 - what is missing is the finding
            result["modules"][module] = f"{type(exc).__name__}: {exc}"
    if result["engine_import"] == "ok":
        result["backends"] = {}
        for name in ("torch", "triton", "flash", "cpu"):
            ok, reason = backend_available(name, ctx.device, torch.bfloat16)
            result["backends"][name] = "available" if ok else reason
        result["cuda_graphs"] = "supported" if len(cuda_graph_modes()) > 1 else "absent"
    logger.info("environment: %s", {k: v for k, v in result.items() if k != "modules"})
    result["status"] = "ok" if result["engine_import"] == "ok" else "error"
