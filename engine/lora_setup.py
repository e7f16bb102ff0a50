"""Start-up of LoRA serving: what it runs with (refused by name otherwise), its slots and its adapters."""

from __future__ import annotations

import logging

from engine.engine_config import EngineConfig
from engine.errors import SettingsConflictError
from engine.lora.lora_manager import LoRAManager
from engine.lora.lora_stack import LoRAKernels, LoRAStack
from engine.kernels.cpu import KERNEL_DTYPES
from engine.layers.invariant_linear import ColumnBlockLinear
from engine.layers.layer_ops import NativeLayerOps
from engine.lora.request import LoRARequest
from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def check_lora_settings(config: EngineConfig, model: LlamaForCausalLM) -> None:
    """Refuse what LoRA does not run with yet: the deltas are added beside plain float products of one
    process's Llama-family model."""
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise SettingsConflictError(
            "--enable-lora cannot be combined with --tensor-parallel-size / --pipeline-parallel-size > 1 yet "
            "(the adapters' matrices are not sharded)"
        )
    if type(model) is not LlamaForCausalLM:
        raise SettingsConflictError(
            f"--enable-lora serves the Llama family (llama, mistral, qwen2, qwen3), not {model.arch.model_type!r}"
        )
    if model.quantization != "none":
        raise SettingsConflictError(
            f"--enable-lora needs float base weights, not --quantization {model.quantization} "
            "(use --quantization none; a GGUF file is then dequantized)"
        )
    if config.batch_invariant:
        raise SettingsConflictError(
            "--enable-lora cannot be combined with --batch-invariant (the deltas' products depend on the batch)"
        )


def build_lora(config: EngineConfig, model: LlamaForCausalLM) -> LoRAManager:
    """Give the model its stacked slots and return the manager, with --lora-modules registered (the first
    max_cpu_loras loaded now, so a bad directory fails the start; the rest on first use)."""
    lora = config.lora
    check_lora_settings(config, model)
    # On CPU with the native kernels, each token's own slots (csrc/lora_delta.h), also inside the fused decode
    # step (benchmarks/lora.py --micro). Else packed for the native column-block product (CPU bf16), where
    # measured twice as fast at decode sizes as torch.mm on the raw matrices; oneDNN's packed fp32 product
    # builds a primitive per new shape, slower here.
    native = model.ops.kernels if isinstance(model.ops, NativeLayerOps) and model.dtype in KERNEL_DTYPES else None
    packs = native is None and isinstance(model.linear, ColumnBlockLinear)
    kernels = LoRAKernels.load() if model.device.type == "cuda" else None  # (else the torch products)
    if model.device.type == "cuda" and kernels is None:
        logger.warning("LoRA: the Triton SGMV kernels cannot be imported; the deltas run as torch products")
    stack = LoRAStack(
        model.arch,
        lora.max_loras,
        lora.max_lora_rank,
        model.dtype,
        model.device,
        model.linear if packs else None,
        kernels,
        native,
    )
    model.lora = stack
    manager = LoRAManager(lora, model.arch.num_layers)
    for index, module in enumerate(lora.lora_modules):
        request = LoRARequest(module.name, module.path)
        if index < lora.cpu_capacity:
            manager.add_lora(request)
        else:
            manager.register(request)
    logger.info(
        "LoRA: %d slots of rank up to %d (%.0f MiB), %d adapters kept loaded, %d registered",
        lora.max_loras,
        lora.max_lora_rank,
        stack.nbytes() / 2**20,
        lora.cpu_capacity,
        len(lora.lora_modules),
    )
    return manager
