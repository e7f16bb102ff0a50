"""Start-up of LoRA serving: what it runs with (refused by name otherwise), its slots and its adapters."""

from __future__ import annotations

import logging
from typing import Any, Optional

from engine.engine_config import EngineConfig
from engine.errors import LoRAAdapterError, LoRARankError, SettingsConflictError
from engine.lora.adapter_layout import AdapterLayout
from engine.lora.expert_layout import ExpertLayout
from engine.lora.expert_stack import ExpertLoRAStack
from engine.lora.gguf_adapter import GgufTarget
from engine.lora.lora_manager import LoRAManager
from engine.lora_shard import AdapterShard
from engine.lora.lora_stack import LoRAKernels, LoRAStack
from engine.kernels.cpu import KERNEL_DTYPES
from engine.layers.invariant_linear import ColumnBlockLinear
from engine.layers.layer_ops import NativeLayerOps
from engine.lora.request import LoRARequest
from engine.models.checkpoint_names import checkpoint_rows
from engine.models.decoder_arch import DecoderArch
from engine.models.deepseek import DeepseekForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_arch import LlamaArch
from engine.models.moe import MoeForCausalLM
from engine.models.moe_arch import MoeArch
from engine.models.registry import check_tensor_parallel_model, moe_arch_of, tensor_parallel_expert_unit

logger = logging.getLogger(__name__)

EXPERT_LORA_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama4_text")
"""The mixtures of experts whose experts take adapters: their experts are transformers' stacked gate|up and down
(Llama 4's transposed, which PEFT's matrices do not see), every block on engine/layers/moe.py's per-expert
products. GPT-OSS's interleaved gate|up with biases, GLM-4.5's, Granite MoE's and Phi-3.5-MoE's experts are not
adapted (their attention is)."""

LORA_BASE_STORAGES = ("none", "gguf", "int8", "int4", "awq", "gptq")
"""The base weights' storages LoRA serves: the deltas are float products of the adapter's own matrices added to
whatever the base projection returned (llama.py), so a quantized product is covered as a float one is; nothing
is merged into the quantized weights."""


def check_lora_settings(config: EngineConfig, model: LlamaForCausalLM) -> None:
    """Refuse what LoRA does not run with yet: the deltas are added beside the base products (float or quantized,
    LORA_BASE_STORAGES) of every family's attention and dense MLP projections (a mixture of experts': its
    attention's and, in EXPERT_LORA_FAMILIES, its experts'; each rank's shard with tensor or pipeline parallelism:
    engine/lora_shard.py)."""
    if isinstance(model, DeepseekForCausalLM):
        raise SettingsConflictError(
            f"--enable-lora does not serve {model.arch.model_type!r}: its latent attention's projections "
            "(q_a_proj, kv_a_proj_with_mqa, ...) have no LoRA deltas here"
        )
    if model.quantization not in LORA_BASE_STORAGES:
        raise SettingsConflictError(
            f"--enable-lora serves bases stored as {', '.join(LORA_BASE_STORAGES)}, not --quantization "
            f"{model.quantization}"
        )
    if config.batch_invariant:
        raise SettingsConflictError(
            "--enable-lora cannot be combined with --batch-invariant (the deltas' products depend on the batch)"
        )


def build_lora(config: EngineConfig, model: LlamaForCausalLM, hf_config: Any) -> LoRAManager:
    """Give the model its stacked slots and return the manager, with --lora-modules registered (the first
    max_cpu_loras loaded now, so a bad directory fails the start; the rest on first use)."""
    lora = config.lora
    stack = attach_lora_stack(config, model, hf_config)
    whole = model.arch if stack.shard is None else stack.shard.whole  # a GGUF adapter's heads are the whole model's
    manager = LoRAManager(lora, whole.num_layers, GgufTarget.of(whole), stack.dtype, stack.layout)
    for index, module in enumerate(lora.lora_modules):
        request = LoRARequest(module.name, module.path)
        try:
            if index < lora.cpu_capacity:
                manager.add_lora(request)
            else:
                manager.register(request)
        except (
            LoRAAdapterError,
            LoRARankError,
        ) as error:  # an adapter given at start that cannot be served is a bad flag (exit 2)
            raise SettingsConflictError(f"--lora-modules: {error.problem}") from error
    logger.info(
        "LoRA: %d slots of rank up to %d (%.0f MiB), %d adapters kept loaded, %d registered",
        lora.max_loras,
        lora.max_lora_rank,
        stack.nbytes() / 2**20,
        lora.cpu_capacity,
        len(lora.lora_modules),
    )
    return manager


def attach_lora_stack(config: EngineConfig, model: LlamaForCausalLM, hf_config: Any) -> LoRAStack:
    """Give the model (this rank's shard: every rank does, worker ranks included) its stacked adapter slots."""
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
    shard = _adapter_shard(model, hf_config)
    whole_moe = _whole_experts(model, hf_config)
    stack = LoRAStack(
        model.arch,
        lora.max_loras,
        lora.max_lora_rank,
        model.dtype,
        model.device,
        model.linear if packs else None,
        kernels,
        shard=shard,
        native=native,
        layout=adapter_layout(model, model.arch if shard is None else shard.whole, whole_moe),
        experts=_expert_stack(config, model) if whole_moe is not None and isinstance(model, MoeForCausalLM) else None,
    )
    model.lora = stack
    return stack


def _whole_experts(model: LlamaForCausalLM, hf_config: Any) -> Optional[MoeArch]:
    """The whole model's experts where they take adapters (EXPERT_LORA_FAMILIES), else None."""
    if not isinstance(model, MoeForCausalLM) or model.arch.model_type not in EXPERT_LORA_FAMILIES:
        return None
    return moe_arch_of(hf_config) if model.tp.is_parallel else model.moe


def _expert_stack(config: EngineConfig, model: MoeForCausalLM) -> ExpertLoRAStack:
    """The slots' expert deltas of this rank's sparse layers (each expert's share of the width its own)."""
    moe = model.moe
    return ExpertLoRAStack(
        tuple(sorted(model.moe_blocks)),
        len(moe.local_experts),
        model.arch.hidden_size,
        moe.expert_intermediate_size,
        config.lora.max_loras,
        config.lora.max_lora_rank,
        model.dtype,
        model.device,
    )


def _adapter_shard(model: LlamaForCausalLM, hf_config: Any) -> Optional[AdapterShard]:
    """This rank's part of the adapters (None: one process holds the whole model)."""
    tp, stage = model.tp, model.stage
    if not tp.is_parallel and not stage.is_split:
        return None
    whole = check_tensor_parallel_model(hf_config, tp.world_size) if tp.is_parallel else model.arch
    # (an expert width that does not split evenly is padded as the base experts were: the deltas line up with them)
    unit = tensor_parallel_expert_unit(hf_config, model.quantizer) if tp.is_parallel else 1
    held = model.moe.held_experts if isinstance(model, MoeForCausalLM) else None  # (expert parallelism)
    return AdapterShard(whole, tp, stage.layers, holds_vocab=stage.is_first, expert_unit=unit, held_experts=held)


def adapter_layout(model: LlamaForCausalLM, whole: LlamaArch, experts: Optional[MoeArch] = None) -> AdapterLayout:
    """How the family's adapters map onto `model`'s projections (`whole`: the whole model's shape): its MLP's kind
    (no dense MLP adapted in a mixture of experts; its experts where `experts`, the whole model's, is given), and
    for the generic decoder's families the checkpoint transform of their base rows (names, per-head q/k/v, RoPE
    halves), which B's rows take too."""
    decoder = whole if isinstance(whole, DecoderArch) else None  # (the Llama family reads Llama's names as they are)
    plain = None if decoder is None else decoder.plain_mlp
    mlp = "none" if isinstance(model, MoeForCausalLM) else "gated" if plain is None else "plain"
    return AdapterLayout(
        whole.model_type,
        whole.q_size,
        whole.kv_size,
        whole.intermediate_size,
        mlp,
        plain or ("up_proj", "down_proj"),
        rows=None if decoder is None else lambda weights: iter(checkpoint_rows(weights, decoder)),
        aliases=tuple(
            (new.strip(".").rsplit(".", 1)[-1], old.strip(".").rsplit(".", 1)[-1])
            for old, new in (() if decoder is None else decoder.renames)
            if new.strip(".").rsplit(".", 1)[-1] in ("o_proj", "qkv_proj")
        ),
        hidden_size=whole.hidden_size,
        experts=None
        if experts is None
        else ExpertLayout(
            experts.num_experts,
            whole.hidden_size,
            experts.expert_intermediate_size,
            experts.sparse_layers,
            experts.expert_names or ("gate_proj", "up_proj", "down_proj"),
            transposed=experts.stacked_transposed,
        ),
    )
