"""Loading an EAGLE or EAGLE-3 draft head for `{"method": "eagle" | "eagle3", "model": DIR}` and checking it
against the target.

The head's directory holds a Llama config (EAGLE-3's may name `draft_vocab_size`, `target_hidden_size`,
`norm_before_residual` and, in `eagle_config`, the target layers it reads: `eagle_aux_hidden_state_layer_ids`, by
default 2, L // 2 and L - 3 of the target's L layers, as vLLM reads them) and its tensors (safetensors or
PyTorch .bin), as the EAGLE authors' checkpoints store them. It runs beside the target in the engine's process
and reads the target's embedding (and EAGLE's, its LM head);
with tensor parallelism, where the target holds a slice of the vocabulary's rows, the head holds all of them,
read from the target's checkpoint at start-up (`full_target_rows`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from engine.attention import AttentionBackend
from engine.attention.kv_cache import KVCache, KVCacheSpec
from engine.errors import SettingsConflictError
from engine.loading.loader import CheckpointError, iter_weights, load_hf_config, prepare_checkpoint
from engine.loading.rope_settings import rope_settings
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_arch import LlamaArch
from engine.spec_decode.eagle import EagleProposer
from engine.spec_decode.eagle_model import EagleHead
from engine.spec_decode.mtp import LoadedMtp
from engine.spec_decode.target_rows import full_target_rows
from engine.spec_decode.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedHead:
    """An EAGLE head loaded beside its target, before its KV cache is sized."""

    head: EagleHead
    backend: AttentionBackend
    spec: KVCacheSpec
    feature_layers: tuple[int, ...]  # EAGLE-3: the target layers whose entering residual stream it reads
    source: str


def load_eagle_head(
    speculative: SpeculativeConfig,
    target: LlamaForCausalLM,
    numerics_for: Callable[[Any], tuple[AttentionBackend, Any, Any]],
    *,
    block_size: int,
    kv_dtype: torch.dtype,
    max_model_len: Optional[int] = None,
    download_dir: Optional[str] = None,
    target_checkpoint: Optional[Path] = None,
) -> LoadedHead:
    """The head of `speculative.model` on the target's device and dtype, through `numerics_for(its HF config)`
    (the attention backend, layer ops and product for its shape); SettingsConflictError when it cannot be read or
    does not fit the target (hidden size, feature layers)."""
    assert speculative.model is not None  # the config's validator requires it for eagle and eagle3
    method, name = speculative.method, speculative.model
    try:
        checkpoint = prepare_checkpoint(name, download_dir=download_dir)
        config = load_hf_config(checkpoint.path)
        if checkpoint.gguf is not None:
            raise CheckpointError("an EAGLE head is read from safetensors or PyTorch .bin files, not GGUF")
    except CheckpointError as error:
        raise SettingsConflictError(
            f"--speculative-config: the {method} head {name!r} cannot be read: {error}"
        ) from error
    if getattr(config, "add_para_norm", False):
        raise SettingsConflictError(f"the {method} head {name!r}: HASS's extra norms (add_para_norm) are not served")
    target_arch = target.arch
    feature_layers = _feature_layers(config, target_arch.num_layers) if method == "eagle3" else ()
    target_hidden = int(getattr(config, "target_hidden_size", None) or config.hidden_size)
    if target_hidden != target_arch.hidden_size or config.hidden_size != target_arch.hidden_size:
        raise SettingsConflictError(
            f"the {method} head {name!r} reads hidden states of width {target_hidden} and is "
            f"{config.hidden_size} wide; the target's are {target_arch.hidden_size} wide (the head reads its "
            "embedding)"
        )
    try:
        arch = LlamaArch.from_hf_config(config, rope_settings(config))
        backend, ops, linear = numerics_for(config)
        head = EagleHead(method, target, arch, target.dtype, target.device, ops, linear, max_model_len=max_model_len)
        head.load_head(list(iter_weights(checkpoint.path)), bool(getattr(config, "norm_before_residual", False)))
    except (ValueError, CheckpointError) as error:
        raise SettingsConflictError(f"the {method} head {name!r} cannot serve this target: {error}") from error
    _check_shapes(head, method, target_arch.hidden_size, len(feature_layers))
    if target.vocab_parallel is not None:
        assert target_checkpoint is not None  # (the builder passes it)
        head.target_rows = full_target_rows(target_checkpoint, target.dtype, target.device)
    spec = KVCacheSpec(arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, kv_dtype)
    logger.info(
        "%s head %s: %d layer(s), %.1f MB of weights%s",
        method,
        checkpoint.source,
        arch.num_layers,
        head.weight_bytes() / 1e6,
        f", reading the target's layers {list(feature_layers)}" if feature_layers else "",
    )
    return LoadedHead(head, backend, spec, feature_layers, checkpoint.source)


def make_eagle_proposer(
    loaded: Union[LoadedHead, LoadedMtp],
    num_blocks: int,
    num_speculative_tokens: int,
    vocab_limit: int,
    max_catch_up_tokens: int,
    max_model_len: Optional[int] = None,
) -> EagleProposer:
    """The proposer over a head KV cache of `num_blocks` blocks (an EAGLE head's, or a prediction layer's). It
    drafts up to the target's `max_model_len` where the head's config names a shorter context (the head runs at
    the target's positions; its rotary tables are built that long, as vLLM raises the draft's value)."""
    head = loaded.head
    max_positions = max(head.arch.max_position_embeddings, max_model_len or 0)
    return EagleProposer(
        head,
        loaded.backend,
        KVCache(loaded.spec, num_blocks, head.device),
        num_speculative_tokens,
        vocab_limit,
        max_catch_up_tokens,
        max_positions,
    )


def _feature_layers(config: Any, num_target_layers: int) -> tuple[int, ...]:
    eagle_config = getattr(config, "eagle_config", None) or {}
    layers = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if layers is None:
        layers = (2, num_target_layers // 2, num_target_layers - 3)
    # in the target's layer order, whatever the order listed: vLLM's (and SGLang's) layer loop appends each
    # layer's stream as it passes it, and fc's three input blocks are trained in that order
    layers = tuple(sorted(int(i) for i in layers))
    if len(layers) != 3 or not all(0 <= i < num_target_layers for i in layers):
        raise SettingsConflictError(
            f"the eagle3 head reads the target's layers {list(layers)}: three of its {num_target_layers} are needed"
        )
    return layers


def _check_shapes(head: EagleHead, method: str, target_hidden: int, num_features: int) -> None:
    hidden = head.arch.hidden_size
    fc_in = head.fc.shape[1] if isinstance(head.fc, torch.Tensor) else None
    want = 3 * target_hidden if method == "eagle3" else 2 * hidden
    if fc_in is not None and fc_in != want:
        raise SettingsConflictError(f"the {method} head's fc reads {fc_in} features; {want} expected")
    if method == "eagle3" and num_features != 3:
        raise SettingsConflictError("an eagle3 head reads three of the target's layers")
