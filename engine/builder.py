"""Building an EngineCore from its configuration: checkpoint, model, KV cache, scheduler."""

from __future__ import annotations

import gc
import logging
import time
from typing import Optional

import torch

from engine.attention import AttentionBackend, get_attention_backend
from engine.batch_invariant import Numerics, batch_invariant_numerics
from engine.engine import EngineCore
from engine.cache_config import DEFAULT_CPU_KV_CACHE_MEMORY
from engine.engine_config import EngineConfig
from engine.runner.kv_cache import KVCache, KVCacheSpec
from engine.loading.loader import iter_weights, load_hf_config, prepare_checkpoint
from engine.runner.memory_profile import cuda_kv_budget, profile_peak_bytes
from engine.runner.model_runner import ModelRunner, RunnerLimits
from engine.models import build_model
from engine.models.llama import LlamaForCausalLM
from engine.text.tokenizer import load_tokenizer
from scheduler import Scheduler

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig, *, served_model_name: Optional[str] = None) -> EngineCore:
    """Load the model and size the KV cache; logs the resulting token capacity."""
    started = time.monotonic()
    model_config = config.model
    if model_config.max_model_len is None and config.scheduler.max_model_len is not None:
        model_config = model_config.model_copy(update={"max_model_len": config.scheduler.max_model_len})
    torch.manual_seed(model_config.seed)
    checkpoint = prepare_checkpoint(model_config.model, revision=model_config.revision)
    hf_config = load_hf_config(checkpoint.path)
    tokenizer_path = checkpoint.path
    if model_config.tokenizer is not None:
        tokenizer_path = prepare_checkpoint(model_config.tokenizer).path
    tokenizer = load_tokenizer(tokenizer_path)
    device = model_config.resolve_device()
    dtype = model_config.resolve_dtype(device)
    max_model_len = model_config.resolve_max_model_len(hf_config)

    backend, ops, linear = _numerics(config, device, dtype)
    model = build_model(hf_config, dtype, device, ops, linear)
    if model.arch.sliding_window is not None and max_model_len > model.arch.sliding_window:
        logger.warning("capping max_model_len %d to the sliding window %d", max_model_len, model.arch.sliding_window)
        max_model_len = model.arch.sliding_window
    model.load_weights(iter_weights(checkpoint.path))
    spec = KVCacheSpec(model.arch.num_layers, config.cache.block_size, model.arch.num_kv_heads,
                       model.arch.head_dim, dtype)
    num_blocks = _num_kv_blocks(config, spec, device, model, backend, max_model_len)
    limits = RunnerLimits(config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens, max_model_len)
    runner = ModelRunner(model, KVCache(spec, num_blocks, device), backend, device, limits)
    scheduler = Scheduler(
        config.scheduler.model_copy(update={"max_model_len": max_model_len}),
        config.cache.for_scheduler(num_blocks),
    )
    gc.collect()
    gc.freeze()  # the weights and long-lived state never need scanning by the cyclic GC
    logger.info(
        "loaded %s (%s, %s on %s) in %.1f s; KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB), "
        "max_model_len %d, attention backend %s",
        checkpoint.source, hf_config.model_type, str(dtype).removeprefix("torch."), device,
        time.monotonic() - started, num_blocks, spec.block_size, num_blocks * spec.block_size,
        num_blocks * spec.bytes_per_block / 2**20, max_model_len, backend.name,
    )
    return EngineCore(config, scheduler, runner, tokenizer, served_model_name or checkpoint.source)


def _numerics(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Numerics:
    """The attention backend, per-token ops and matrix product the model runs with."""
    if config.batch_invariant:
        return batch_invariant_numerics(config.attention_backend, device, dtype)
    backend = get_attention_backend(config.attention_backend, device, dtype, block_size=config.cache.block_size)
    return Numerics(backend, backend.layer_ops(), None)


def _num_kv_blocks(config: EngineConfig, spec: KVCacheSpec, device: torch.device, model: LlamaForCausalLM,
                   backend: AttentionBackend, max_model_len: int) -> int:
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.kv_cache_memory is not None:
        budget = int(cache.kv_cache_memory)
    elif device.type == "cuda":
        scheduler = config.scheduler
        step_tokens = scheduler.max_num_batched_tokens
        peak = profile_peak_bytes(model, backend, spec, step_tokens, scheduler.max_num_seqs, max_model_len,
                                  device)
        budget = cuda_kv_budget(cache.gpu_memory_utilization, peak, device)
        logger.info("profiled a %d-token prefill and a %d-request decode at %d tokens: %.0f MiB of activations "
                    "at peak", step_tokens, scheduler.max_num_seqs, max_model_len, peak / 2**20)
    else:
        budget = DEFAULT_CPU_KV_CACHE_MEMORY
    num_blocks = spec.num_blocks_for(budget)
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget / 2**20:.0f} MiB) holds no block of {spec.bytes_per_block} bytes; "
            "raise kv_cache_memory / gpu_memory_utilization or set num_blocks"
        )
    return num_blocks
