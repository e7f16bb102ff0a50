"""Part: whether the engine imports and torch sees the device, versions, which attention backends load.

What it finds first (`engine_import`, `cuda_available`) tells the parent whether the other parts
can run at all; the rest is recorded best-effort. Each flash-attn generation is looked for on its
own at each block size it is measured at (`flash-attn 4, block 16`, ...): what `flash` would pick
depends on the block size, and flash-attn 2 serves none below 256.
"""

from __future__ import annotations

import importlib

import torch

from gpucheck.common import (
    FLASH_GENERATIONS,
    PartContext,
    backend_available,
    cuda_graph_modes,
    environment,
    find_flash,
    flash_label,
    logger,
)

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
        for name in ("torch", "triton", "cpu"):
            ok, reason = backend_available(name, ctx.device, torch.bfloat16)
            result["backends"][name] = "available" if ok else reason
        for generation, block_sizes in FLASH_GENERATIONS.items():
            for block_size in block_sizes:
                try:
                    backend, why = find_flash(generation, ctx.device, torch.bfloat16, block_size)
                except Exception as exc:  # noqa: BLE001 - the finding itself
                    backend, why = None, f"{type(exc).__name__}: {exc}"
                key = f"{flash_label(generation)}, block {block_size}"
                result["backends"][key] = "available" if backend is not None else why
        result["cuda_graphs"] = "supported" if len(cuda_graph_modes()) > 1 else "absent"
    logger.info("environment: %s", {k: v for k, v in result.items() if k != "modules"})
    result["status"] = "ok" if result["engine_import"] == "ok" else "error"
