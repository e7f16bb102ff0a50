"""One rank's part of an engine: its model (the whole model, or its tensor-parallel shard) with weights loaded,
its attention numerics, its KV cache's layout and size: what the engine's process and every worker build alike."""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
import logging
from typing import Callable, Iterable, Optional, Union, cast

import torch

from engine.errors import SettingsConflictError
from engine.attention import AttentionBackend
from engine.attention.attention_shape import AttentionShape, latent_rank_of
from engine.attention.layer_attention import check_backend_serves, features_of, missing_features
from engine.attention.local_chunks import check_chunk
from engine.attention.step_metadata import computes_bidirectional_spans
from engine.cache_config import DEFAULT_CPU_KV_CACHE_MEMORY
from engine.huge_pages import back_weights_with_huge_pages
from engine.engine_config import EngineConfig
from engine.attention.kv_groups import KVGroups
from engine.attention.kv_cache import KVCache, KVCacheSpec, resolve_kv_cache_dtype
from engine.loading.loader import Checkpoint, is_vision_language, iter_weights, load_hf_config
from engine.profiling.memory_bandwidth import tensor_bytes
from engine.loading.model_weights import model_weights, resolve_gguf_storage
from engine.runner.memory_profile import cuda_kv_budget, profile_peak_bytes
from engine.runner.cuda_graphs import decode_buckets
from engine.runner.model_runner import ModelRunner, RunnerLimits
from engine.models import build_model
from engine.pooling.pooler_config import resolve_runner
from engine.models.registry import FAMILIES, check_tensor_parallel_model, family_of, moe_arch_of
from engine.models.registry import delta_net_shape_of, held_experts_of, mamba_shape_of, recurrent_width_of
from engine.models.registry import tensor_parallel_expert_unit
from engine.models.llama import LlamaForCausalLM
from engine.models.vision_language import (
    VISION_LANGUAGE_FAMILIES,
    VisionEncoder,
    VisionLanguageFamily,
    text_weights,
    vision_family_of,
)
from engine.models.tensor_parallel import check_group_split, shard_weights
from engine.distributed.parallel_group import ParallelGroup
from engine.distributed.pipeline_stage import PipelineStage
from engine.platform import Numerics, choose_numerics
from engine.quantization.awq import awq_weights, quantization_config
from engine.quantization.fp8_checkpoint import fp8_checkpoint_weights
from engine.quantization.gptq import GPTQ, GptqConfig, gptq_weights
from engine.quantization.int4_groups import Int4Groups
from engine.quantization.quantized_weight import QuantizedWeight
from engine.quantization.weight_quantizer import WeightQuantizer, resolve_group_size, resolve_quantization

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Shard:
    """One rank's model (the whole model without tensor parallelism) and what its runner is built from."""

    model: LlamaForCausalLM
    backend: AttentionBackend
    spec: KVCacheSpec
    kv_groups: KVGroups
    limits: RunnerLimits
    buckets: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    vision: Optional[VisionEncoder] = None  # a vision-language model's image encoder (its language model: `model`)


def resolved_model_config(config: EngineConfig):
    """The model section, its max_model_len taken from the scheduler's when only that is set."""
    model_config = config.model
    if model_config.max_model_len is None and config.scheduler.max_model_len is not None:
        model_config = model_config.model_copy(update={"max_model_len": config.scheduler.max_model_len})
    return model_config


def build_shard(
    config: EngineConfig,
    checkpoint: Checkpoint,
    hf_config,
    tp: ParallelGroup,
    stage: Optional[PipelineStage] = None,
) -> Shard:
    """This rank's model with its weights loaded (all of them without tensor parallelism; its stage's layers
    only with pipeline parallelism), its attention numerics, its KV cache's layout and the runner's limits:
    what rank 0 and every worker build alike."""
    model_config = resolved_model_config(config)
    device = model_config.resolve_device()
    dtype = model_config.resolve_dtype(device)
    max_model_len = model_config.resolve_max_model_len(hf_config)
    latent_rank = latent_rank_of(hf_config)  # multi-head latent attention: the cache holds the latent
    shape = AttentionShape.from_hf_config(hf_config)
    if tp.is_parallel:  # this rank's heads (check_shardable refuses a model whose heads do not divide)
        shape = shape._replace(
            num_heads=shape.num_heads // tp.world_size,
            num_kv_heads=max(shape.num_kv_heads // tp.world_size, 1),
        )

    def numerics(needs: frozenset[str] = frozenset()) -> Numerics:
        return choose_numerics(
            config.attention_backend,
            device,
            dtype,
            block_size=config.cache.block_size,
            shape=shape,
            latent=latent_rank is not None,
            batch_invariant=config.batch_invariant,
            kv_cache_dtype=config.cache.kv_cache_dtype,
            needs=needs,
        )

    backend, ops, linear = numerics()
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, backend)
    requested = None if model_config.quantization == "auto" else model_config.quantization
    vision_family, whole_config = _vision_language(checkpoint, config)
    # (a vision-language checkpoint's quantization_config sits at the top of its config.json, beside text_config)
    quantized_config = hf_config if whole_config is None else whole_config
    quantizer = _quantizer(
        requested, model_config.quantization_group_size, quantized_config, device, dtype, config.batch_invariant
    )
    family = family_of(hf_config)
    if checkpoint.gguf is not None and "gguf" not in family.formats:
        raise ValueError(
            f"{family.architecture} is served from HF checkpoints ({', '.join(family.formats)}), "
            "not from GGUF files; GGUF is supported for "
            f"{', '.join(f.architecture for f in FAMILIES if 'gguf' in f.formats)}"
        )
    if vision_family is not None and stage is not None and stage.is_split:
        raise SettingsConflictError(
            f"--pipeline-parallel-size {stage.num_stages}: {vision_family.architecture} (a vision-language model) "
            "is served with one pipeline stage"
        )
    bidirectional = vision_family is not None and vision_family.bidirectional_images
    if bidirectional and config.batch_invariant and model_config.max_images:
        assert vision_family is not None
        raise SettingsConflictError(
            f"--batch-invariant: {vision_family.architecture}'s image tokens attend to each other both ways, "
            "which batch-invariant attention (every query a causal decode row) does not compute; serve it "
            "without --batch-invariant, or as a text model with --limit-mm-per-prompt '{\"image\": 0}'"
        )
    expert_parallel = config.parallel.enable_expert_parallel and tp.is_parallel
    model = build_model(hf_config, dtype, device, ops, linear, quantizer, max_model_len, tp, expert_parallel)
    model.keeps_lm_head = resolve_runner(model_config.runner, model_config.convert, hf_config) == "generate"
    # Layers that attend alike share a block table; sliding-window layers free the blocks behind their window. The
    # groups are the whole model's (the scheduler's, the same on every stage); a stage's cache holds its layers'.
    # Chunked local attention (Llama 4) frees the blocks before each request's chunk, but the KV tiers hold one
    # full-attention group: with a tier its layers stay in the full group (their blocks kept, as a full layer's).
    layer_chunks = () if config.cache.tier_flags else [attention.chunk for attention in model.attention_layers]
    windows = [attention.sliding_window for attention in model.attention_layers]
    kv_groups = KVGroups.of(windows, max_model_len, layer_chunks)
    if stage is not None and stage.is_split:
        model.hold_stage(stage)
        logger.info("pipeline %s", stage.describe())
    if (
        device.type == "cuda"
        and config.attention_backend == "auto"
        and missing_features(backend, model.attention_layers)
    ):
        # auto chose before the model's layers said what they compute: choose again, passing over a flash-attn
        # release without one of their features (flash-attn 2 has no attention sinks: GPT-OSS). CUDA numerics
        # bring no layer ops or products, so the model built without them stands. (On CPU, auto's cpu backend
        # computes all but latent attention, which auto gives torch.)
        backend = numerics(features_of(model.attention_layers)).backend
        kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, backend)
    check_backend_serves(backend, model.attention_layers, family.architecture)
    # (a GPTQ checkpoint dequantized at load, asked for by name or not, is read as a float checkpoint's)
    stored_as = "none" if quantizer is None and model_config.quantization == GPTQ else model_config.quantization
    storage = (
        quantizer.method
        if quantizer is not None
        else resolve_gguf_storage(stored_as, checkpoint.gguf, device, dtype, config.batch_invariant)
    )
    if tp.is_parallel:
        _check_parallel_storage(quantizer, hf_config, tp)
    model.quantization = storage
    weights: Iterable[tuple[str, Union[torch.Tensor, QuantizedWeight, Int4Groups]]]
    if quantizer is None:
        full = AttentionShape.from_hf_config(hf_config)  # GGUF's q/k rows are un-permuted by the whole model's
        weights = model_weights(storage, checkpoint.path, checkpoint.gguf, full.num_heads, full.num_kv_heads)
        if vision_family is not None:  # (the language model's tensors, by the names its model reads)
            weights = text_weights(weights, vision_family)
        stored = quantization_config(quantized_config)
        if stored is not None and str(stored.get("quant_method", "")).lower() == GPTQ:
            # a GPTQ checkpoint whose matrices are dequantized at load (no int4 groups kept): floats, as a float
            # checkpoint's, for every family and product a float checkpoint takes
            weights = gptq_weights(cast(Iterable[tuple[str, torch.Tensor]], weights), GptqConfig.from_config(stored))
    else:  # the quantizer takes the checkpoint's tensors as stored (an AWQ or GPTQ one's layers grouped first)
        tensors = iter_weights(checkpoint.path)
        if vision_family is not None:
            tensors = text_weights(tensors, vision_family)
        if quantizer.method == "awq":
            assert quantizer.group_size is not None  # the AWQ checkpoint's own (resolve_group_size)
            weights = awq_weights(tensors, quantizer.group_size)
        elif quantizer.method == GPTQ:
            weights = gptq_weights(tensors, GptqConfig.from_config(quantization_config(quantized_config) or {}))
        else:
            weights = tensors
    # An FP8 checkpoint's matrices in the model's dtype before any cut (exact), as a float checkpoint's would be.
    weights = fp8_checkpoint_weights(weights, quantized_config, dtype, device)
    if tp.is_parallel:
        full_arch = check_tensor_parallel_model(hf_config, tp.world_size)
        unit = tensor_parallel_expert_unit(hf_config, quantizer)  # (as build_model's experts were padded)
        held = held_experts_of(hf_config, tp) if expert_parallel else None
        mamba, delta_net = mamba_shape_of(hf_config), delta_net_shape_of(hf_config)
        quantize_whole = _whole_rows_quantizer(quantizer, dtype, device)
        weights = shard_weights(weights, full_arch, tp, quantize_whole, unit, held, mamba, delta_net)
    model.load_weights(weights)
    vision = None
    if vision_family is not None and not vision_family.images:
        logger.info("%s served as a text model: its images are not served", vision_family.architecture)
    elif vision_family is not None and model_config.max_images == 0:
        logger.info("%s served as a text model: --limit-mm-per-prompt allows no image", vision_family.architecture)
    elif vision_family is not None:
        vision = VisionEncoder.load(checkpoint.path, whole_config, vision_family, dtype, device)
        logger.info(
            "vision encoder (%s): %.1f M parameters, %s",
            vision_family.architecture,
            vision.num_parameters / 1e6,
            str(dtype).removeprefix("torch."),
        )
        if vision_family.bidirectional_images and not computes_bidirectional_spans(backend):
            logger.info(
                "attention backend %s computes causal attention only: the steps that compute an image of %s (its "
                "tokens attend to each other both ways) run through the torch backend",
                backend.name,
                vision_family.architecture,
            )
    _log_weights(model)
    if device.type == "cpu":
        back_weights_with_huge_pages(model)
    spec = KVCacheSpec(
        len(model.attention_layers),  # (a hybrid model's recurrent layers keep states of their own instead)
        config.cache.block_size,
        model.arch.num_kv_heads,
        model.arch.head_dim,
        kv_dtype,
        latent_rank=latent_rank,  # MLA: the latent layout
        layer_groups=kv_groups.held(model.stage.layers) if kv_groups.num_groups > 1 else (),
    )
    speculative = config.speculative_config
    limits = RunnerLimits(
        config.scheduler.max_num_seqs,
        config.scheduler.max_num_batched_tokens,
        max_model_len,
        0 if speculative is None else speculative.num_speculative_tokens,
    )
    chunks = {attention.chunk for attention in model.attention_layers if attention.chunk is not None}
    for chunk in chunks:
        try:
            check_chunk(chunk, config.cache.block_size)
        except ValueError as error:
            raise SettingsConflictError(str(error)) from None
    if chunks and device.type == "cuda":
        # (a decode graph would replay the virtual requests of the step it captured: local_chunks builds them from
        # the step's host copies)
        logger.info("CUDA graphs off: the model's chunked local attention cuts each step at its chunks' boundaries")
    recurrent = model.recurrent_state_bytes(1) > 0
    if recurrent:
        _check_recurrent(config, family.architecture)
        if device.type == "cuda":
            logger.info("CUDA graphs off: the recurrent layers scan each request's rows on their own")
    buckets = (
        ()
        if model.stage.is_split or not model.keeps_lm_head or chunks or recurrent
        else _graph_buckets(config, device, backend)
    )
    return Shard(model, backend, spec, kv_groups, limits, buckets, device, dtype, max_model_len, vision)


def _vision_language(checkpoint: Checkpoint, config: EngineConfig) -> tuple[Optional[VisionLanguageFamily], object]:
    """A vision-language checkpoint's family and whole config ((None, None) for a text model); ValueError for a
    vision-language architecture not served here."""
    if checkpoint.gguf is not None:
        return None, None
    whole = load_hf_config(checkpoint.path, trust_remote_code=config.model.trust_remote_code, whole=True)
    if not is_vision_language(whole):
        return None, None
    family = vision_family_of(whole)
    if family is None:
        raise ValueError(
            f"vision-language architecture {list(whole.architectures or [whole.model_type])} is not supported; "
            f"supported: {', '.join(f.architecture for f in VISION_LANGUAGE_FAMILIES)}"
        )
    return family, whole


def _check_parallel_storage(quantizer: Optional[WeightQuantizer], hf_config, tp: ParallelGroup) -> None:
    """SettingsConflictError for int4 groups (quantized at load, or an AWQ or GPTQ checkpoint's) that a rank's input
    columns would cut (GGUF blocks are checked per tensor as they are cut, shard_weights; a GPTQ checkpoint
    dequantized at load is floats, cut anywhere)."""
    if quantizer is not None and quantizer.group_size is not None:
        arch = check_tensor_parallel_model(hf_config, tp.world_size)
        moe = moe_arch_of(hf_config)
        what = {"awq": "an AWQ checkpoint", "gptq": "a GPTQ checkpoint"}.get(quantizer.method, "--quantization int4")
        storage_name = f"{what} (group size {quantizer.group_size})"
        check_group_split(arch, tp.world_size, quantizer.group_size, storage_name, moe, recurrent_width_of(hf_config))


def _whole_rows_quantizer(
    quantizer: Optional[WeightQuantizer], dtype: torch.dtype, device: torch.device
) -> Optional[Callable[[torch.Tensor], QuantizedWeight]]:
    """int8's: a row-parallel matrix quantized whole (its rows' scales), in the model's dtype as the model would."""
    if quantizer is None or quantizer.method != "int8":
        return None

    def quantize(weight: torch.Tensor) -> QuantizedWeight:
        quantized = quantizer(weight.to(dtype=dtype, device=device))
        assert isinstance(quantized, QuantizedWeight)  # int8 quantizes every float matrix
        return quantized

    return quantize


def _check_recurrent(config: EngineConfig, architecture: str) -> None:
    """SettingsConflictError for what a model with recurrent states (a hybrid model's recurrent layers) is not
    served with: each request's state summarises its whole prefix, so no other request's cached blocks, no KV
    tier and no rejected draft can stand for or be taken out of it; batch-invariant mode's promise would need the
    scans to read the same chunks whatever the batch."""
    refused = {
        "--speculative-config": config.speculative_config is not None,
        "--enable-lora": config.lora.enable_lora,
        "--batch-invariant": config.batch_invariant,
        "--swap-space / --kv-cache-dir (KV tiers)": bool(config.cache.tier_flags),
    }
    for flag, given in refused.items():
        if given:
            raise SettingsConflictError(
                f"{flag}: {architecture} keeps a recurrent state per request in its recurrent layers, which this "
                "is not served with"
            )


NO_BLOCK_LIMIT = 2**62
"""The blocks a rank without attention layers holds (it stores none): any other rank's count is smaller."""


def shard_kv_blocks(config: EngineConfig, shard: Shard, tp: ParallelGroup, draft_bytes_per_block: int = 0) -> int:
    """The KV blocks of this rank's cache: the fewest any rank's budget holds (every rank's cache indexes the
    same block ids). The requests and the recurrent states' snapshots every rank holds go into `shard.limits`."""
    num_blocks, rows, snapshots = _num_kv_blocks(
        config,
        shard.spec,
        shard.device,
        shard.model,
        shard.backend,
        shard.limits,
        shard.buckets,
        draft_bytes_per_block,
        shard.kv_groups,
    )
    rows = tp.min_over_ranks(rows)
    snapshots = tp.min_over_ranks(snapshots)  # (NO_BLOCK_LIMIT from every rank: no rank keeps recurrent states)
    shard.limits = dataclasses.replace(
        shard.limits,
        max_num_seqs=min(rows, shard.limits.max_num_seqs),  # (the engine's builder gives the scheduler the same)
        num_state_snapshots=None if snapshots == NO_BLOCK_LIMIT else snapshots,
    )
    return tp.min_over_ranks(num_blocks)


def _quantizer(
    requested: Optional[str],
    group_size: Optional[int],
    hf_config,
    device: torch.device,
    dtype: torch.dtype,
    batch_invariant: bool = False,
) -> Optional[WeightQuantizer]:
    """The load-time weight quantizer for --quantization (None: auto) and --quantization-group-size (None:
    unset) on the checkpoint (None: weights as stored); ValueError for a group size that would not apply."""
    method, awq_group_size = resolve_quantization(requested, hf_config)
    group_size = resolve_group_size(requested, method, group_size, awq_group_size)
    if method is None or (method == GPTQ and group_size is None):  # (a GPTQ checkpoint dequantized at load)
        return None
    if batch_invariant:
        raise SettingsConflictError(
            f"--quantization {method} cannot be combined with --batch-invariant (its products are "
            "float ones whose rows do not depend on the batch)"
        )
    if group_size is not None and device.type == "cpu" and dtype == torch.float32:  # int4 groups
        logger.warning(
            "int4 weights with float32 activations run torch's slow fp32 int4 kernel on CPU (measured "
            "~20x a bf16 product); --dtype bfloat16 is much faster where the CPU has bf16"
        )
    return WeightQuantizer(method, group_size, device)


def _log_weights(model: LlamaForCausalLM) -> None:
    matrices = model.weight_tensors()
    formats = sorted({w.format if isinstance(w, QuantizedWeight) else _dtype_name(w) for w in matrices})
    logger.info(
        "model weights: %.1f MB (quantization %s; %.1f MB of matrices read per decode step: %s)",
        model.weight_bytes() / 1e6,
        model.quantization,
        tensor_bytes(matrices) / 1e6,
        ", ".join(formats),
    )


def _dtype_name(weight) -> str:
    """A float matrix's dtype (packed batch-invariant weights keep theirs in `data`)."""
    tensor = weight if isinstance(weight, torch.Tensor) else weight.data
    return str(tensor.dtype).removeprefix("torch.")


def _cuda_graph_bytes(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    spec: KVCacheSpec,
    limits: RunnerLimits,
    buckets: tuple[int, ...],
    device: torch.device,
) -> int:
    """Device memory the decode graphs take (their shared pool and the graphs themselves), measured by
    capturing them over a throwaway cache of one request's blocks and releasing them, before the KV cache
    is sized (the real graphs capture over the real cache afterwards)."""
    scratch = ModelRunner(model, KVCache(spec, 1, device), backend, device, limits)  # padding rows read only
    # the padding block
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info(device)
    capture_graphs(scratch, buckets)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # warm-up activations are not graph memory; the graphs' pool stays
    free_after, _ = torch.cuda.mem_get_info(device)
    del scratch
    gc.collect()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()  # a workspace made for the capture stream pins its pool
    torch.cuda.empty_cache()
    return max(free_before - free_after, 0)


def _graph_buckets(config: EngineConfig, device: torch.device, backend: AttentionBackend) -> tuple[int, ...]:
    """The decode batch sizes to capture as CUDA graphs (none off CUDA, with --enforce-eager, when the
    backend cannot run in a graph, in a pipeline stage, whose input arrives from another process, or for a
    pooling model, whose steps are prompt chunks only: a graph would never replay)."""
    if device.type != "cuda":
        return ()
    if config.enforce_eager:
        logger.info("CUDA graphs off (enforce_eager): every step runs eagerly")
        return ()
    if not backend.cuda_graphs:
        logger.info("CUDA graphs off: attention backend %s runs eagerly only", backend.name)
        return ()
    return decode_buckets(config.scheduler.max_num_seqs)


def _num_kv_blocks(
    config: EngineConfig,
    spec: KVCacheSpec,
    device: torch.device,
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    limits: RunnerLimits,
    buckets: tuple[int, ...],
    draft_bytes_per_block: int,
    kv_groups: KVGroups,
) -> tuple[int, int, int]:
    """(KV blocks, requests at most, snapshots of recurrent states) from the budget; with a draft model, each block
    of the target's comes with one of the draft's (`draft_bytes_per_block`) from the same budget.

    A model with recurrent states keeps a state per running request from the budget too, and for prefix caching as
    many snapshots of states (--state-snapshots; scheduler/state_snapshots.py). When --max-num-seqs was not given
    and these would take more than half of the budget, fewer requests run (a hybrid model's states can be tens of
    MiB each: 256 of them would leave no room for the attention layers' blocks). Snapshots NO_BLOCK_LIMIT: this
    rank keeps no recurrent state (the other ranks' counts hold)."""
    cache = config.cache
    rows = limits.max_num_seqs
    per_row = model.recurrent_state_bytes(1)  # a hybrid model's: a row per running request, and per snapshot
    wanted = cache.state_snapshots
    if (
        not cache.enable_prefix_caching
        or cache.mamba_cache_mode == "none"
        or any(kv_groups.windows)  # (a sliding or chunked group's hits are not served with snapshots)
        or any(kv_groups.chunks)
    ):
        wanted = 0  # (no hit to restore)
    if cache.num_blocks is not None:  # (the states beside the blocks given, as many snapshots as requests)
        if not per_row:
            return cache.num_blocks, rows, NO_BLOCK_LIMIT
        snapshots = rows if wanted is None else wanted
        logger.info(
            "states of the recurrent layers: %.0f MiB (%d requests and %d snapshots for prefix caching x %.1f MiB), "
            "beside the %d KV blocks given",
            per_row * (rows + snapshots) / 2**20,
            rows,
            snapshots,
            per_row / 2**20,
            cache.num_blocks,
        )
        return cache.num_blocks, rows, snapshots
    if cache.kv_cache_memory is not None:
        budget = int(cache.kv_cache_memory)
    elif device.type == "cuda":
        # Verification rows (a request and its drafts) sample like decodes: the decode step profiled is that wide.
        step_tokens, max_rows, max_model_len = (
            limits.max_num_batched_tokens,
            limits.max_query_rows,
            limits.max_model_len,
        )
        peak = profile_peak_bytes(model, backend, spec, step_tokens, max_rows, max_model_len, device)
        graphs = _cuda_graph_bytes(model, backend, spec, limits, buckets, device) if buckets else 0
        budget = cuda_kv_budget(cache.gpu_memory_utilization, peak, device) - graphs
        logger.info(
            "profiled a %d-token prefill and a %d-request decode at %d tokens: %.0f MiB of activations "
            "at peak; CUDA graphs take %.0f MiB",
            step_tokens,
            max_rows,
            max_model_len,
            peak / 2**20,
            graphs / 2**20,
        )
    else:
        budget = DEFAULT_CPU_KV_CACHE_MEMORY
    snapshots = NO_BLOCK_LIMIT
    if per_row:
        rows, snapshots = _fit_recurrent_states(config, per_row, rows, wanted, budget)
        budget -= per_row * (rows + snapshots)
    if spec.bytes_per_block + draft_bytes_per_block == 0:  # a pipeline stage of a hybrid model's recurrent layers
        return NO_BLOCK_LIMIT, rows, snapshots  # (no KV of its own: the other stages' budgets size the pool)
    num_blocks = budget // (spec.bytes_per_block + draft_bytes_per_block) - 1  # KVCache adds its padding block
    if num_blocks < 1:
        raise SettingsConflictError(
            f"the KV cache budget ({budget / 2**20:.0f} MiB) holds no block of {spec.bytes_per_block} bytes; "
            "raise kv_cache_memory / gpu_memory_utilization or set num_blocks"
        )
    return num_blocks, rows, snapshots


def _fit_recurrent_states(
    config: EngineConfig, per_row: int, rows: int, wanted: Optional[int], budget: int
) -> tuple[int, int]:
    """(requests, snapshots) whose recurrent states (`per_row` bytes each) the budget holds.

    The requests' states and the snapshots (`wanted`, --state-snapshots) share at most half the budget where either
    count is the default: without --max-num-seqs fewer requests run (half the share each, when the snapshots are
    the default too); without --state-snapshots there are as many snapshots as requests, or as many as the share
    leaves beside them (none: no prefix caching). Counts both given are taken as they are, and refused only when
    they fill the whole budget."""
    share = budget // 2 // per_row  # the rows half the budget holds
    rows_given = "max_num_seqs" in config.scheduler.model_fields_set
    if not rows_given and rows + (rows if wanted is None else wanted) > share:
        fitted = share // 2 if wanted is None else share - wanted
        if fitted < 1:
            raise SettingsConflictError(
                f"--state-snapshots {wanted} take half the KV cache budget ({budget / 2**20:.0f} MiB) by themselves "
                f"({per_row / 2**20:.1f} MiB each); lower --state-snapshots or raise kv_cache_memory / "
                "gpu_memory_utilization"
            )
        logger.info(
            "max_num_seqs %d -> %d: the recurrent states of %d requests%s would take more than half the KV cache "
            "budget (%.0f MiB); --max-num-seqs sets it",
            rows,
            fitted,
            rows,
            " and as many snapshots" if wanted is None else f" and {wanted} snapshots",
            budget / 2**20,
        )
        rows = fitted
    snapshots = wanted if wanted is not None else min(rows, max(share - rows, 0))
    states = per_row * (rows + snapshots)
    logger.info(
        "states of the recurrent layers: %.0f MiB (%d requests and %d snapshots for prefix caching x %.1f MiB), from "
        "the KV cache budget",
        states / 2**20,
        rows,
        snapshots,
        per_row / 2**20,
    )
    if states >= budget:
        raise SettingsConflictError(
            f"the recurrent states of --max-num-seqs {rows} requests and {snapshots} snapshots "
            f"({states / 2**20:.0f} MiB) take the whole KV cache budget ({budget / 2**20:.0f} MiB); lower "
            "--max-num-seqs or --state-snapshots, or raise kv_cache_memory / gpu_memory_utilization"
        )
    return rows, snapshots


def capture_graphs(runner: ModelRunner, buckets: tuple[int, ...]) -> None:
    try:
        runner.capture_decode_graphs(buckets)
    except Exception as exc:
        raise RuntimeError(
            f"capturing the decode CUDA graphs failed with attention backend {runner.backend.name} "
            f"({type(exc).__name__}: {exc}); start with --enforce-eager to run without them"
        ) from exc
