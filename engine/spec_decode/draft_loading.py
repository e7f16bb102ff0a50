"""Loading the draft model of `{"method": "draft_model"}` and checking that it can draft for the target.

A draft must share the target's vocabulary: a draft token is a target token id, so the two tokenizers must map
the same strings to the same ids and agree on the special tokens. The models' embedding sizes may differ (padded
rows past the tokenizer's ids): drafts are taken among the ids both models have. A `.gguf` draft keeps its
quantized blocks on the native CPU kernels where they run (`quantization` auto), which makes the target's own
GGUF, dequantized for the target, a cheap draft of it (a quantized self-draft). A vision-language checkpoint
drafts with its language model alone: it reads an image's placeholder tokens as tokens, never seeing the image, so
its drafts after an image are guesses the target rejects more often (the target's tokens stay the same).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from engine.attention import AttentionBackend
from engine.attention.attention_shape import latent_rank_of
from engine.attention.kv_cache import KVCache, KVCacheSpec
from engine.attention.layer_attention import check_backend_serves
from engine.errors import SettingsConflictError
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.loading.loader import (
    Checkpoint,
    CheckpointError,
    is_vision_language,
    load_hf_config,
    prepare_checkpoint,
    text_config_of,
)
from engine.loading.model_weights import model_weights, resolve_gguf_storage
from engine.models import build_model
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import family_of, recurrent_layers_of
from engine.models.vision_language import VisionLanguageFamily, text_weights, vision_family_of
from engine.quantization.fp8_checkpoint import fp8_checkpoint_weights
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.speculative_config import SpeculativeConfig
from engine.text.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftModel:
    """A loaded draft, before its KV cache is sized."""

    model: LlamaForCausalLM
    backend: AttentionBackend
    spec: KVCacheSpec  # its cache's block layout (the target's block size and KV dtype)
    vocab_limit: int  # drafts are taken among ids below this
    max_positions: int  # the draft's context
    source: str


@dataclass(frozen=True)
class DraftCheckpoint:
    """A draft's checkpoint, checked against the target's vocabulary, before its numerics are chosen."""

    checkpoint: Checkpoint
    hf_config: Any
    architecture: str
    vocab_limit: int  # drafts are taken among ids below this
    vision: Optional[VisionLanguageFamily] = None  # a vision-language checkpoint's (its language model drafts)


def read_draft_checkpoint(
    speculative: SpeculativeConfig,
    target_tokenizer: Tokenizer,
    target_vocab_size: int,
    *,
    trust_remote_code: bool = False,
    download_dir: Optional[str] = None,
) -> DraftCheckpoint:
    """The draft's checkpoint and config; SettingsConflictError when it cannot draft for the target (another
    vocabulary, an architecture not served)."""
    assert speculative.model is not None  # the config's validator requires it for draft_model
    try:
        checkpoint = prepare_checkpoint(speculative.model, download_dir=download_dir)
        hf_config = load_hf_config(checkpoint.path, trust_remote_code=trust_remote_code, whole=True)
    except CheckpointError as error:  # a draft that cannot be had is a bad setting, not the target's fault
        raise SettingsConflictError(
            f"--speculative-config: the draft model {speculative.model!r} cannot be read: {error}"
        ) from error
    vision = None
    if is_vision_language(hf_config):  # (its checkpoint names the language model's tensors under a prefix)
        vision = vision_family_of(hf_config)
        if vision is None:
            raise SettingsConflictError(
                f"the draft model {speculative.model!r} is a vision-language model of an architecture not served "
                f"({list(hf_config.architectures or [])})"
            )
        hf_config = text_config_of(hf_config)
    try:
        family = family_of(hf_config)
    except ValueError as error:
        raise SettingsConflictError(f"the draft model {speculative.model!r} cannot be served: {error}") from error
    # (a draft's forward passes carry no recurrent states: a recurrent layer would read each pass's rows as one
    # sequence from zero, and no rejected draft can be taken back out of a state)
    if recurrent_layers_of(hf_config):
        raise SettingsConflictError(
            f"--speculative-config: the draft model's architecture {family.architecture} keeps a recurrent state per "
            "request in its recurrent layers, which a draft model is not served with"
        )
    if checkpoint.gguf is not None and "gguf" not in family.formats:
        raise SettingsConflictError(f"the draft model's architecture {family.architecture} is not served from GGUF")
    try:
        draft_tokenizer: Optional[Tokenizer] = load_tokenizer(checkpoint.path, trust_remote_code=trust_remote_code)
    except CheckpointError:
        draft_tokenizer = None  # a bare checkpoint: the vocabulary sizes and special ids are compared instead
    vocab_limit = check_same_vocabulary(target_tokenizer, draft_tokenizer, target_vocab_size, hf_config)
    return DraftCheckpoint(checkpoint, hf_config, family.architecture, vocab_limit, vision)


def load_draft_model(
    draft: DraftCheckpoint,
    quantization: str,
    numerics: tuple[AttentionBackend, Optional[TorchLayerOps], Optional[Linear]],
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype,
    batch_invariant: bool = False,
) -> DraftModel:
    """The draft's weights on the target's device and dtype, through `numerics` (the backend, layer ops and
    product chosen for the draft's shape); SettingsConflictError for a `quantization` that cannot run."""
    backend, ops, linear = numerics
    checkpoint, hf_config = draft.checkpoint, draft.hf_config
    model = build_model(hf_config, dtype, device, ops, linear)
    check_backend_serves(backend, model.attention_layers, draft.architecture)
    storage = _storage(quantization, checkpoint.gguf, device, dtype, batch_invariant)
    model.quantization = storage
    arch = model.arch
    stored = model_weights(storage, checkpoint.path, checkpoint.gguf, arch.num_heads, arch.num_kv_heads)
    weights = fp8_checkpoint_weights(stored, hf_config, dtype, device)  # (an FP8 draft: dequantized as it loads)
    model.load_weights(weights if draft.vision is None else text_weights(weights, draft.vision))
    latent_rank = latent_rank_of(hf_config)
    spec = KVCacheSpec(arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, kv_dtype, latent_rank=latent_rank)
    logger.info(
        "draft model %s (%s, quantization %s): %.1f MB of weights, %d layers",
        checkpoint.source,
        draft.architecture,
        storage,
        model.weight_bytes() / 1e6,
        arch.num_layers,
    )
    # its rotary tables end at max_position_embeddings
    return DraftModel(model, backend, spec, draft.vocab_limit, arch.max_position_embeddings, checkpoint.source)


def make_draft_proposer(
    draft: DraftModel, num_blocks: int, device: torch.device, num_speculative_tokens: int, max_catch_up_tokens: int
) -> DraftModelProposer:
    """The proposer over a draft KV cache of `num_blocks` blocks."""
    cache = KVCache(draft.spec, num_blocks, device)
    return DraftModelProposer(
        draft.model,
        draft.backend,
        cache,
        num_speculative_tokens,
        draft.vocab_limit,
        max_catch_up_tokens,
        draft.max_positions,
    )


def check_same_vocabulary(
    target: Tokenizer, draft: Optional[Tokenizer], target_vocab_size: int, draft_hf_config
) -> int:
    """The ids below which both models draft and verify the same tokens; SettingsConflictError saying what
    differs otherwise. Without a draft tokenizer, its config's vocabulary size and special ids must match."""
    draft_vocab_size = int(draft_hf_config.vocab_size)
    if draft is None:
        if draft_vocab_size != target_vocab_size:
            raise SettingsConflictError(
                f"the draft model's vocabulary ({draft_vocab_size} tokens, no tokenizer to compare) differs from "
                f"the target's ({target_vocab_size})"
            )
        eos = getattr(draft_hf_config, "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if eos_ids and not eos_ids <= target.eos_token_ids:
            raise SettingsConflictError(
                f"the draft model's eos ids {sorted(eos_ids)} are not the target's {sorted(target.eos_token_ids)}"
            )
        return draft_vocab_size
    target_vocab, draft_vocab = target.hf.get_vocab(), draft.hf.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(
            t for t in target_vocab.keys() | draft_vocab.keys() if target_vocab.get(t) != draft_vocab.get(t)
        )
        raise SettingsConflictError(
            f"the draft model's tokenizer differs from the target's ({len(draft_vocab)} vs {len(target_vocab)} "
            f"tokens, {len(differing)} mapped differently, e.g. {differing[:3]}): a draft must share the "
            "target's vocabulary"
        )
    specials = {
        "bos": (target.hf.bos_token_id, draft.hf.bos_token_id),
        "eos": (sorted(target.eos_token_ids), sorted(draft.eos_token_ids)),
        "pad": (target.hf.pad_token_id, draft.hf.pad_token_id),
    }
    for name, (want, got) in specials.items():
        if want != got:
            raise SettingsConflictError(f"the draft model's {name} token ids {got} are not the target's {want}")
    if draft_vocab_size < len(target.hf):
        raise SettingsConflictError(
            f"the draft model's embedding has {draft_vocab_size} rows, fewer than its tokenizer's {len(target.hf)} "
            "tokens"
        )
    return min(target_vocab_size, draft_vocab_size)


def _storage(requested: str, gguf_file, device: torch.device, dtype: torch.dtype, batch_invariant: bool) -> str:
    """The draft's weight storage: auto keeps a .gguf draft quantized where its kernels run."""
    try:
        return resolve_gguf_storage(
            "gguf" if requested == "auto" else requested, gguf_file, device, dtype, batch_invariant
        )
    except ValueError as error:
        if requested == "auto":
            return "none"
        raise SettingsConflictError(f"the draft model's quantization: {error}") from error
