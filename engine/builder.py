"""Building an EngineCore from its configuration: checkpoint, model, KV cache, scheduler."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Optional, Union

import torch

from engine.attention.attention_shape import AttentionShape, latent_rank_of
from engine.engine import EngineCore
from engine.engine_config import EngineConfig
from engine.attention.kv_cache import KVCache
from engine.loading.generation_defaults import read_sampling_defaults
from engine.loading.loader import (
    Checkpoint,
    CheckpointError,
    load_hf_config,
    prepare_checkpoint,
    prepare_tokenizer_source,
)
from engine.runner.model_runner import RunnerLimits
from engine.runner.step_timing import STEP_COST_MAX_ROWS, measure_step_cost
from engine.spec_decode.draft_loading import DraftModel, load_draft_model, make_draft_proposer, read_draft_checkpoint
from engine.spec_decode.eagle_loading import LoadedHead, load_eagle_head, make_eagle_proposer
from engine.spec_decode.eagle_model import METHODS as EAGLE_METHODS
from engine.spec_decode.last_state_proposer import LastStateDrafter, LastStateProposer
from engine.spec_decode.medusa_loading import load_medusa_heads
from engine.spec_decode.mlp_speculator_loading import load_mlp_speculator
from engine.spec_decode.mtp import LoadedMtp, load_mtp_head
from engine.spec_decode.speculative_config import SpeculativeConfig
from engine.distributed.parallel_group import ParallelGroup
from engine.distributed.pipeline_stage import PipelineStage
from engine.errors import SettingsConflictError
from engine.lora_setup import build_lora
from engine.ray_workers import start_ray_workers
from engine.kernels.cpu import KERNEL_DTYPES, start_build
from engine.kv_tier_setup import check_kv_tiers, open_disk_tier, open_kv_tiers, open_memory_tier
from engine.tp_workers import TensorParallelWorkers, make_runner
from engine.shard_builder import Shard, build_shard, capture_graphs, resolved_model_config, shard_kv_blocks
from engine.platform import choose_numerics
from engine.pooling.pooler_config import ModelPooler, model_pooler, resolve_runner, resolve_task
from engine.profiling.step_profile import StepProfile
from engine.multimodal.processor import MultiModalProcessor
from engine.structured.grammar_compiler import GrammarCompiler
from engine.structured.grammar_decoder import GrammarDecoder
from engine.text.tokenizer import Tokenizer, load_tokenizer
from scheduler import Scheduler
from scheduler.config import CacheConfig
from scheduler.scheduler import AnyDraftProposer

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig, *, served_model_name: Optional[str] = None) -> EngineCore:
    """Load the model and size the KV cache; logs the resulting token capacity. With tensor parallelism the
    other ranks' worker processes start first and load their shards beside this one (engine/tp_workers.py)."""
    started = time.monotonic()
    if config.cpu_threads is not None:
        set_cpu_threads(config.cpu_threads)
    model_config = resolved_model_config(config)
    if config.attention_backend in ("auto", "cpu") and model_config.device != "cuda":  # (cuda: checked later)
        device = model_config.resolve_device()
        if device.type == "cpu" and model_config.resolve_dtype(device) in KERNEL_DTYPES:
            start_build()  # a first start compiles the native kernels while it converts and reads the model
    torch.manual_seed(model_config.seed)
    checkpoint = prepare_checkpoint(
        model_config.model, revision=model_config.revision, download_dir=model_config.download_dir
    )
    hf_config = load_hf_config(
        checkpoint.path, trust_remote_code=model_config.trust_remote_code, overrides=model_config.hf_overrides
    )
    # eos ids of the generation config the sampling defaults come from (vLLM's): the model's, or the
    # --generation-config directory's (also when the tokenizer comes from elsewhere)
    generation_dir = model_config.generation_config
    try:
        tokenizer_path = checkpoint.path
        if model_config.tokenizer is not None:
            tokenizer_path = prepare_tokenizer_source(
                model_config.tokenizer, revision=model_config.tokenizer_revision, download_dir=model_config.download_dir
            )
        tokenizer = load_tokenizer(
            tokenizer_path,
            trust_remote_code=model_config.trust_remote_code,
            chat_template=model_config.chat_template,
            generation_config_dir=checkpoint.path if generation_dir in ("auto", "vllm") else generation_dir,
        )
    except CheckpointError as error:
        if model_config.tokenizer is None:
            raise
        # a --tokenizer that cannot be had is a bad setting, not the model's fault ("cannot load the model")
        raise SettingsConflictError(
            f"--tokenizer: the tokenizer {model_config.tokenizer!r} cannot be read: {error}"
        ) from error
    default_sampling = read_sampling_defaults(  # (before workers)
        model_config.generation_config, checkpoint.path, model_config.override_generation_config
    )
    workers: Optional[TensorParallelWorkers] = None
    tp = ParallelGroup.single()
    parallel = config.parallel
    if parallel.pipeline_parallel_size > 1 and config.speculative_config is not None:
        raise SettingsConflictError(
            f"--pipeline-parallel-size {parallel.pipeline_parallel_size} cannot be combined with speculative "
            "decoding (a step's drafts would wait for the step before it through every stage)"
        )
    if parallel.world_size > 1:
        if parallel.distributed_executor_backend == "ray":
            workers = start_ray_workers(config, hf_config)
        else:
            workers = TensorParallelWorkers.start(config, checkpoint, hf_config)
        tp = workers.group
    try:
        return _build_rank0(
            config, checkpoint, hf_config, tokenizer, tp, workers, served_model_name, default_sampling, started
        )
    except BaseException:
        if workers is not None:
            workers.stop()
        raise


def set_cpu_threads(threads: int) -> None:
    """torch's intra-op pool (and so the native kernels' OpenMP teams, which torch sizes per thread) and its
    inter-op pool at `threads`. The engine and loading threads start later and take this size."""
    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() != threads:
        with contextlib.suppress(RuntimeError):  # settable once per process, before any inter-op work
            torch.set_num_interop_threads(threads)


def _build_rank0(
    config: EngineConfig,
    checkpoint: Checkpoint,
    hf_config,
    tokenizer: Tokenizer,
    tp: ParallelGroup,
    workers: Optional["TensorParallelWorkers"],
    served_model_name: Optional[str],
    default_sampling: dict[str, Any],
    started: float,
) -> EngineCore:
    parallel = config.parallel
    pooler = _pooler(config, checkpoint, hf_config)  # (before the weights load: a bad setting fails at once)
    stage = PipelineStage.of_rank(
        0, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, hf_config.num_hidden_layers
    )
    shard = build_shard(config, checkpoint, hf_config, tp, stage)
    if pooler is not None and pooler.task == "classify":
        _check_classifier(shard.model.classifier, len(pooler.labels), shard.model.arch.hidden_size)
    model, backend, spec, limits, device, dtype = (
        shard.model,
        shard.backend,
        shard.spec,
        shard.limits,
        shard.device,
        shard.dtype,
    )
    kv_groups, max_model_len, buckets = shard.kv_groups, shard.max_model_len, shard.buckets
    processor = _image_processor(config, checkpoint, shard)
    # (before the runner: its slots)
    lora_manager = build_lora(config, model, hf_config) if config.lora.enable_lora else None
    kv_dtype = spec.dtype
    speculative = config.speculative_config
    draft = None
    head: Optional[Union[LoadedHead, LoadedMtp]] = None
    last_state: Optional[LastStateDrafter] = None  # Medusa's heads, an MLP speculator
    if speculative is not None and speculative.method == "draft_model":
        draft = _draft_model(config, speculative, tokenizer, model.arch.vocab_size, device, dtype, kv_dtype)
    elif speculative is not None and speculative.method in EAGLE_METHODS:
        head = load_eagle_head(
            speculative,
            model,
            _head_numerics(config, device, dtype),
            block_size=config.cache.block_size,
            kv_dtype=kv_dtype,
            max_model_len=max_model_len,
            download_dir=config.model.download_dir,
            target_checkpoint=checkpoint.path,
        )
        model.feature_layers = head.feature_layers
    elif speculative is not None and speculative.method == "mtp":
        head = load_mtp_head(
            hf_config,
            checkpoint.path,
            model,
            _head_numerics(config, device, dtype),
            block_size=config.cache.block_size,
            kv_dtype=kv_dtype,
            max_model_len=max_model_len,
        )
    elif speculative is not None and speculative.method == "medusa":
        last_state = load_medusa_heads(
            speculative, model, download_dir=config.model.download_dir, target_checkpoint=checkpoint.path
        )
    elif speculative is not None and speculative.method == "mlp_speculator":
        last_state = load_mlp_speculator(speculative, model, download_dir=config.model.download_dir)
    # A draft's (or a head's) cache holds as many blocks as the target's, from the same budget.
    draft_spec = draft.spec if draft is not None else None if head is None else head.spec
    draft_bytes = 0 if draft_spec is None else draft_spec.bytes_per_block
    num_blocks = shard_kv_blocks(config, shard, tp, draft_bytes)
    limits = shard.limits  # (a model with recurrent states may run fewer requests than asked for by default)
    grammar_compiler = GrammarCompiler(tokenizer.hf, model.arch.vocab_size, tokenizer.eos_token_ids)
    check_kv_tiers(config, shard)
    kv_tier = open_disk_tier(config, checkpoint, hf_config, shard, rank=0)
    kv_cache = KVCache(spec, num_blocks, device)
    memory_tier = open_memory_tier(config, hf_config, kv_cache, rank=0)
    runner = make_runner(
        shard,
        kv_cache,
        stage,
        grammar=GrammarDecoder(grammar_compiler, limits.max_num_seqs, device),
        profile=_step_profile(device) if config.profile else None,
        peers=workers,
        kv_tier=kv_tier,
        memory_tier=memory_tier,
    )
    if head is not None:  # the runner's step outputs carry the target's features the head reads
        runner.draft_features = "tapped" if head.feature_layers else "final"
    if last_state is not None:  # (they read the last hidden states, after the final norm)
        runner.draft_features = "final"
    if buckets:
        capture_graphs(runner, buckets)
    step_cost = draft_cost = None
    if speculative is not None and speculative.step_cost_model:
        rows = min(limits.max_query_rows, STEP_COST_MAX_ROWS)
        step_cost = measure_step_cost(model, backend, spec, device, rows, lockstep=tp.is_parallel)
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
    elif head is not None and speculative is not None:
        proposer = make_eagle_proposer(
            head,
            num_blocks,
            speculative.num_speculative_tokens,
            model.arch.vocab_size,
            limits.max_num_batched_tokens,
            max_model_len,
        )
        logger.info(
            "%s head KV cache: %d blocks (%.0f MiB)", speculative.method, num_blocks, num_blocks * draft_bytes / 2**20
        )
    elif last_state is not None and speculative is not None:
        proposer = LastStateProposer(last_state, speculative.num_speculative_tokens, model.arch.vocab_size)
    elif speculative is not None:
        proposer = speculative.make_proposer()
    scheduler = Scheduler(
        # as many steps in flight as there are pipeline stages, so that every stage has one to run
        config.scheduler.model_copy(
            update={
                "max_model_len": max_model_len,
                "max_concurrent_batches": parallel.pipeline_parallel_size,
                "max_num_seqs": limits.max_num_seqs,
            }
        ),
        _scheduler_cache(config, num_blocks, limits),
        proposer=proposer,
        adaptive_drafts=speculative is not None and speculative.adaptive,
        max_drafting_batch=None if speculative is None else speculative.disable_by_batch_size,
        step_cost=step_cost,
        kv_group_windows=kv_groups.windows,
        kv_group_chunks=kv_groups.chunks,
        draft_cost=draft_cost,
        max_loras=None if lora_manager is None else config.lora.max_loras,
        kv_tiers=open_kv_tiers(config, hf_config, kv_tier, memory_tier, kv_cache),
    )
    if not kv_groups.is_uniform:
        kinds = [
            f"window {window}" if window else f"chunk {chunk}" if chunk else "full"
            for window, chunk in zip(kv_groups.windows, kv_groups.chunks)
        ]
        logger.info(
            "KV cache layer groups (kind: layers): %s; a sliding or chunked group frees the blocks no query reads",
            "; ".join(f"{kind}: {len(layers)}" for kind, layers in zip(kinds, kv_groups.layers)),
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
    return EngineCore(
        config,
        scheduler,
        runner,
        tokenizer,
        served_model_name or checkpoint.source,
        grammar_compiler,
        lora_manager,
        default_sampling=default_sampling,
        model_source=checkpoint.source,
        pooler=pooler,
        processor=processor,
    )


def _scheduler_cache(config: EngineConfig, num_blocks: int, limits: RunnerLimits) -> CacheConfig:
    """The scheduler's cache section: a model with recurrent states (a hybrid model's recurrent layers) caches
    prefixes only with snapshots of them (a state summarises a request's whole prefix: cached blocks alone cannot
    restore it)."""
    cache = config.cache.for_scheduler(num_blocks, limits.num_state_snapshots or 0)
    if limits.num_state_snapshots != 0 or not cache.enable_prefix_caching:  # (None: no recurrent state at all)
        return cache
    logger.info(
        "prefix caching off: a hit needs a snapshot of the recurrent layers' states, and there are none "
        "(--state-snapshots 0, no room for any beside the requests' states, or KV layer groups with a sliding "
        "window or chunks)"
    )
    return cache.model_copy(update={"enable_prefix_caching": False})


def _image_processor(config: EngineConfig, checkpoint: Checkpoint, shard: Shard) -> Optional[MultiModalProcessor]:
    """A vision-language model's processor (None for a text model, or one served without images)."""
    model_config = config.model
    if shard.vision is None:
        if model_config.limit_mm_per_prompt and model_config.max_images:
            raise SettingsConflictError("--limit-mm-per-prompt applies to a vision-language model")
        return None
    processor = MultiModalProcessor.load(
        checkpoint.path,
        shard.vision.image_token_id,
        model_config.max_images,
        model_config.trust_remote_code,
        shard.vision.family.layout,
        shard.vision.family.bidirectional_images,
        shard.vision.rope,
    )
    logger.info(
        "images: up to %d per prompt, placeholder %r (token %d), processor %s",
        processor.max_images,
        processor.image_placeholder,
        processor.image_token_id,
        type(processor.hf.image_processor).__name__,
    )
    return processor


def _check_classifier(classifier: Optional[torch.Tensor], num_labels: int, hidden_size: int) -> None:
    if classifier is None:
        raise ValueError("a classification model's checkpoint needs its classifier, score.weight; it has none")
    if tuple(classifier.shape) != (num_labels, hidden_size):
        raise ValueError(
            f"score.weight is {list(classifier.shape)}; the config's {num_labels} labels over a hidden size of "
            f"{hidden_size} need [{num_labels}, {hidden_size}]"
        )


def _pooler(config: EngineConfig, checkpoint: Checkpoint, hf_config: Any) -> Optional[ModelPooler]:
    """The pooler of a model served for pooling (embeddings); None for a generative one."""
    model_config = config.model
    if resolve_runner(model_config.runner, model_config.convert, hf_config) == "generate":
        if model_config.pooler_config is not None:
            raise SettingsConflictError("--pooler-config applies to a pooling model (--runner pooling)")
        return None
    if config.speculative_config is not None:
        raise SettingsConflictError("speculative decoding drafts generated tokens: a pooling model generates none")
    task = resolve_task(model_config.convert, hf_config)
    pooler = model_pooler(hf_config, checkpoint.path, model_config.pooler_config, task)
    if task == "classify":
        logger.info(
            "pooling model (classification): %s pooling, %d labels (%s), %s",
            pooler.type.value,
            len(pooler.labels),
            ", ".join(pooler.labels[:8]),
            f"{pooler.activation} of the logits" if pooler.activation else "raw logits",
        )
        return pooler
    logger.info(
        "pooling model (embeddings): %s pooling%s, %d dimensions%s",
        pooler.type.value,
        ", normalized" if pooler.normalize else ", not normalized",
        pooler.hidden_size,
        "" if pooler.matryoshka is None else f" (matryoshka: {list(pooler.matryoshka) or 'any'})",
    )
    return pooler


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
        kv_cache_dtype=config.cache.kv_cache_dtype,
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


def _head_numerics(config: EngineConfig, device: torch.device, dtype: torch.dtype):
    """The parts a draft head runs with, chosen for its own shape (its HF config) as the target's are."""

    def numerics_for(head_config: Any):
        return choose_numerics(
            config.attention_backend,
            device,
            dtype,
            block_size=config.cache.block_size,
            shape=AttentionShape.from_hf_config(head_config),
            latent=latent_rank_of(head_config) is not None,
            kv_cache_dtype=config.cache.kv_cache_dtype,
        )

    return numerics_for


def _step_profile(device: torch.device) -> StepProfile:
    """`--profile`: each step's phases timed (on CUDA, after the device has caught up)."""
    return StepProfile((lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None)
