"""Building an EngineCore from its configuration: checkpoint, model, KV cache, scheduler."""

from __future__ import annotations

import gc
import logging
import time
from typing import Iterable, Optional, Union

import torch

from engine.errors import SettingsConflictError
from engine.attention import AttentionBackend
from engine.attention.attention_shape import AttentionShape, latent_rank_of
from engine.attention.layer_attention import check_backend_serves
from engine.engine import EngineCore
from engine.cache_config import DEFAULT_CPU_KV_CACHE_MEMORY
from engine.engine_config import EngineConfig
from engine.attention.kv_groups import KVGroups
from engine.attention.kv_cache import KVCache, KVCacheSpec, resolve_kv_cache_dtype
from engine.loading.loader import iter_weights, load_hf_config, prepare_checkpoint
from engine.profiling.memory_bandwidth import tensor_bytes
from engine.loading.model_weights import model_weights, resolve_gguf_storage
from engine.runner.memory_profile import cuda_kv_budget, profile_peak_bytes
from engine.runner.cuda_graphs import decode_buckets
from engine.runner.model_runner import ModelRunner, RunnerLimits
from engine.runner.step_timing import measure_step_cost
from engine.spec_decode.draft_loading import DraftModel, load_draft_model, make_draft_proposer, read_draft_checkpoint
from engine.spec_decode.speculative_config import SpeculativeConfig
from engine.models import build_model
from engine.models.registry import FAMILIES, family_of
from engine.models.llama import LlamaForCausalLM
from engine.platform import choose_numerics
from engine.quantization.awq import awq_weights
from engine.quantization.int4_groups import Int4Groups
from engine.quantization.quantized_weight import QuantizedWeight
from engine.quantization.weight_quantizer import WeightQuantizer, resolve_group_size, resolve_quantization
from engine.profiling.step_profile import StepProfile
from engine.structured.grammar_compiler import GrammarCompiler
from engine.structured.grammar_decoder import GrammarDecoder
from engine.text.tokenizer import Tokenizer, load_tokenizer
from scheduler import Scheduler
from scheduler.scheduler import AnyDraftProposer

logger = logging.getLogger(__name__)

STEP_COST_MAX_ROWS = 64
"""Decode rows timed at start-up for speculation's step-cost model at most (beyond, its cost is extrapolated)."""


def build_engine(config: EngineConfig, *, served_model_name: Optional[str] = None) -> EngineCore:
    """Load the model and size the KV cache; logs the resulting token capacity."""
    started = time.monotonic()
    model_config = config.model
    if model_config.max_model_len is None and config.scheduler.max_model_len is not None:
        model_config = model_config.model_copy(update={"max_model_len": config.scheduler.max_model_len})
    torch.manual_seed(model_config.seed)
    checkpoint = prepare_checkpoint(
        model_config.model, revision=model_config.revision, download_dir=model_config.download_dir
    )
    hf_config = load_hf_config(checkpoint.path, trust_remote_code=model_config.trust_remote_code)
    tokenizer_path = checkpoint.path
    if model_config.tokenizer is not None:
        tokenizer_path = prepare_checkpoint(model_config.tokenizer, download_dir=model_config.download_dir).path
    tokenizer = load_tokenizer(
        tokenizer_path, trust_remote_code=model_config.trust_remote_code, chat_template=model_config.chat_template
    )
    device = model_config.resolve_device()
    dtype = model_config.resolve_dtype(device)
    max_model_len = model_config.resolve_max_model_len(hf_config)

    latent_rank = latent_rank_of(hf_config)  # multi-head latent attention: the cache holds the latent
    backend, ops, linear = choose_numerics(
        config.attention_backend,
        device,
        dtype,
        block_size=config.cache.block_size,
        shape=AttentionShape.from_hf_config(hf_config),
        latent=latent_rank is not None,
        batch_invariant=config.batch_invariant,
    )
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, device, backend)
    requested = None if model_config.quantization == "auto" else model_config.quantization
    quantizer = _quantizer(
        requested, model_config.quantization_group_size, hf_config, device, dtype, config.batch_invariant
    )
    family = family_of(hf_config)
    if checkpoint.gguf is not None and "gguf" not in family.formats:
        raise ValueError(
            f"{family.architecture} is served from HF checkpoints ({', '.join(family.formats)}), "
            "not from GGUF files; GGUF is supported for "
            f"{', '.join(f.architecture for f in FAMILIES if 'gguf' in f.formats)}"
        )
    model = build_model(hf_config, dtype, device, ops, linear, quantizer, max_model_len)
    check_backend_serves(backend, model.attention_layers, family.architecture)
    # Layers that attend alike share a block table; sliding-window layers free the blocks behind their window.
    kv_groups = KVGroups.of([attention.sliding_window for attention in model.attention_layers], max_model_len)
    storage = (
        quantizer.method
        if quantizer is not None
        else resolve_gguf_storage(model_config.quantization, checkpoint.gguf, device, dtype, config.batch_invariant)
    )
    model.quantization = storage
    weights: Iterable[tuple[str, Union[torch.Tensor, QuantizedWeight, Int4Groups]]]
    if quantizer is None:
        weights = model_weights(
            storage, checkpoint.path, checkpoint.gguf, model.arch.num_heads, model.arch.num_kv_heads
        )
    else:  # the quantizer takes the checkpoint's tensors as stored (an AWQ one's triples grouped first)
        tensors = iter_weights(checkpoint.path)
        if quantizer.method == "awq":
            assert quantizer.group_size is not None  # the AWQ checkpoint's own (resolve_group_size)
            weights = awq_weights(tensors, quantizer.group_size)
        else:
            weights = tensors
    model.load_weights(weights)
    _log_weights(model)
    spec = KVCacheSpec(
        model.arch.num_layers,
        config.cache.block_size,
        model.arch.num_kv_heads,
        model.arch.head_dim,
        kv_dtype,
        latent_rank=latent_rank,  # MLA: the latent layout
        layer_groups=kv_groups.layers if kv_groups.num_groups > 1 else (),
    )
    speculative = config.speculative_config
    draft = None
    if speculative is not None and speculative.method == "draft_model":
        draft = _draft_model(config, speculative, tokenizer, model.arch.vocab_size, device, dtype, kv_dtype)
    limits = RunnerLimits(
        config.scheduler.max_num_seqs,
        config.scheduler.max_num_batched_tokens,
        max_model_len,
        0 if speculative is None else speculative.num_speculative_tokens,
    )
    buckets = _graph_buckets(config, device, backend)
    # A draft's cache holds as many blocks as the target's, from the same budget.
    draft_bytes = 0 if draft is None else draft.spec.bytes_per_block
    num_blocks = _num_kv_blocks(config, spec, device, model, backend, limits, buckets, draft_bytes)
    grammar_compiler = GrammarCompiler(tokenizer.hf, model.arch.vocab_size, tokenizer.eos_token_ids)
    runner = ModelRunner(
        model,
        KVCache(spec, num_blocks, device),
        backend,
        device,
        limits,
        grammar=GrammarDecoder(grammar_compiler, limits.max_num_seqs, device),
        profile=_step_profile(device) if config.profile else None,
    )
    if buckets:
        _capture(runner, buckets)
    step_cost = draft_cost = None
    if speculative is not None and speculative.step_cost_model:
        step_cost = measure_step_cost(model, backend, spec, device, min(limits.max_query_rows, STEP_COST_MAX_ROWS))
        logger.info(
            "decode step by rows (ms), for weighing draft tokens: %s",
            ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in zip(step_cost.rows, step_cost.seconds)),
        )
        if draft is not None:  # the draft's forwards, one row per request drafted for
            rows = min(limits.max_num_seqs, STEP_COST_MAX_ROWS)
            draft_cost = measure_step_cost(draft.model, draft.backend, draft.spec, device, rows)
            logger.info(
                "draft model forward by rows (ms): %s",
                ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in zip(draft_cost.rows, draft_cost.seconds)),
            )
    proposer: Optional[AnyDraftProposer] = None
    if draft is not None and speculative is not None:
        proposer = make_draft_proposer(
            draft, num_blocks, device, speculative.num_speculative_tokens, limits.max_num_batched_tokens
        )
        logger.info(
            "draft model KV cache: %d blocks (%.0f MiB) beside the target's",
            num_blocks,
            num_blocks * draft_bytes / 2**20,
        )
    elif speculative is not None:
        proposer = speculative.make_proposer()
    scheduler = Scheduler(
        config.scheduler.model_copy(update={"max_model_len": max_model_len}),
        config.cache.for_scheduler(num_blocks),
        proposer=proposer,
        adaptive_drafts=speculative is not None and speculative.adaptive,
        max_drafting_batch=None if speculative is None else speculative.disable_by_batch_size,
        step_cost=step_cost,
        kv_group_windows=kv_groups.windows,
        draft_cost=draft_cost,
    )
    if kv_groups.num_groups > 1 or kv_groups.windows[0] is not None:
        logger.info(
            "KV cache layer groups (window: layers): %s; a sliding group frees the blocks behind its window",
            "; ".join(
                f"{window or 'full'}: {len(layers)}" for window, layers in zip(kv_groups.windows, kv_groups.layers)
            ),
        )
    if speculative is not None:
        logger.info(
            "speculative decoding: %s, up to %d draft tokens per request and step",
            speculative.method,
            speculative.num_speculative_tokens,
        )
    logger.info(
        "loaded %s (%s, %s on %s) in %.1f s; KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB, %s), "
        "max_model_len %d, attention backend %s, CUDA graphs %s",
        checkpoint.source,
        hf_config.model_type,
        str(dtype).removeprefix("torch."),
        device,
        time.monotonic() - started,
        num_blocks,
        spec.block_size,
        num_blocks * spec.block_size,
        num_blocks * spec.bytes_per_block / 2**20,
        str(kv_dtype).removeprefix("torch."),
        max_model_len,
        backend.name,
        runner.cuda_graphs,
    )
    return EngineCore(config, scheduler, runner, tokenizer, served_model_name or checkpoint.source, grammar_compiler)


def _draft_model(
    config: EngineConfig,
    speculative: SpeculativeConfig,
    tokenizer: Tokenizer,
    target_vocab_size: int,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> DraftModel:
    """`draft_model`'s draft, checked against the target, with numerics chosen for its own shape."""
    checkpoint = read_draft_checkpoint(
        speculative,
        tokenizer,
        target_vocab_size,
        trust_remote_code=config.model.trust_remote_code,
        download_dir=config.model.download_dir,
    )
    numerics = choose_numerics(
        config.attention_backend,
        device,
        dtype,
        block_size=config.cache.block_size,
        shape=AttentionShape.from_hf_config(checkpoint.hf_config),
        latent=latent_rank_of(checkpoint.hf_config) is not None,
        batch_invariant=config.batch_invariant,
    )
    return load_draft_model(
        checkpoint,
        speculative.quantization,
        numerics,
        device,
        dtype,
        config.cache.block_size,
        kv_dtype,
        config.batch_invariant,
    )


def _step_profile(device: torch.device) -> StepProfile:
    """`--profile`: each step's phases timed (on CUDA, after the device has caught up)."""
    return StepProfile((lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None)


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
    if method is None:
        return None
    if batch_invariant:
        raise SettingsConflictError(
            f"--quantization {method} cannot be combined with --batch-invariant (its products are "
            "float ones whose rows do not depend on the batch)"
        )
    if method != "int8" and device.type == "cpu" and dtype == torch.float32:
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
    _capture(scratch, buckets)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # warm-up activations are not graph memory; the graphs' pool stays
    free_after, _ = torch.cuda.mem_get_info(device)
    del scratch
    gc.collect()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()  # a workspace made for the capture stream pins its pool
    torch.cuda.empty_cache()
    return max(free_before - free_after, 0)


def _capture(runner: ModelRunner, buckets: tuple[int, ...]) -> None:
    try:
        runner.capture_decode_graphs(buckets)
    except Exception as exc:
        raise RuntimeError(
            f"capturing the decode CUDA graphs failed with attention backend {runner.backend.name} "
            f"({type(exc).__name__}: {exc}); start with --enforce-eager to run without them"
        ) from exc


def _graph_buckets(config: EngineConfig, device: torch.device, backend: AttentionBackend) -> tuple[int, ...]:
    """The decode batch sizes to capture as CUDA graphs (none off CUDA, with --enforce-eager, or when the
    backend cannot run in a graph)."""
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
    draft_bytes_per_block: int = 0,
) -> int:
    """KV blocks from the budget; with a draft model, each block of the target's comes with one of the draft's
    (`draft_bytes_per_block`) from the same budget."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
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
    num_blocks = budget // (spec.bytes_per_block + draft_bytes_per_block) - 1  # KVCache adds its padding block
    if num_blocks < 1:
        raise SettingsConflictError(
            f"the KV cache budget ({budget / 2**20:.0f} MiB) holds no block of {spec.bytes_per_block} bytes; "
            "raise kv_cache_memory / gpu_memory_utilization or set num_blocks"
        )
    return num_blocks
