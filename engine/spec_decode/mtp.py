"""Multi-token prediction (`{"method": "mtp"}`): the target's own prediction layer drafts (DeepSeek-V3, GLM-4.5).

Such a checkpoint stores, past its num_hidden_layers decoder layers, `num_nextn_predict_layers` more: each a
decoder layer of the family's own kind (its attention, its mixture of experts) with a head of its own:

    x    = eh_proj([enorm(embed(token p + 1)); hnorm(feature p)])     (the embedding is zero at position 0)
    out  = the decoder layer over x (x its residual stream)           feature p: the target's final hidden state
    logits = shared_head.head(shared_head.norm(out))                  (after its final norm) at position p

A later draft reads the layer's own `out` before it as its feature, as vLLM runs it. The layer runs as a one-layer
model of the target's family (engine/models/, its layer loop started from x), over its own paged KV cache, by
the proposer EAGLE heads run by (engine/spec_decode/eagle.py). The first prediction layer serves every draft.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.attention_shape import latent_rank_of
from engine.attention.kv_cache import KVCacheSpec
from engine.errors import SettingsConflictError
from engine.loading.loader import iter_weights
from engine.models import build_model
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import family_of
from engine.quantization.fp8_checkpoint import fp8_checkpoint_weights
from engine.spec_decode.target_rows import full_target_rows

logger = logging.getLogger(__name__)

MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
"""The families whose checkpoints' prediction layers are served."""


class MtpHead:
    """The prediction layer's head: the draft-head interface of engine/spec_decode/eagle.py."""

    def __init__(self, block: LlamaForCausalLM, enorm: torch.Tensor, hnorm: torch.Tensor, eh_proj: Any):
        self.block = block  # the prediction layer as a one-layer model (its final norm and LM head: shared_head's)
        self.enorm, self.hnorm, self.eh_proj = enorm, hnorm, eh_proj
        self.arch = block.arch
        self.device = block.device
        self.dtype = block.dtype

    def weight_bytes(self) -> int:
        return self.block.weight_bytes() + sum(t.numel() * t.element_size() for t in (self.enorm, self.hnorm))

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's final hidden states, as they are."""
        return features.to(self.dtype)

    @torch.inference_mode()
    def forward_head(
        self,
        input_ids: torch.Tensor,  # [T]: token p + 1 at each row
        positions: torch.Tensor,  # [T]: p
        features: torch.Tensor,  # [T, hidden]
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: Sequence[AttentionMetadata],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        block, ops, eps = self.block, self.block.ops, self.arch.rms_norm_eps
        embeds = block.embed_tokens(input_ids).masked_fill((positions == 0)[:, None], 0.0)
        x = torch.cat([ops.rms_norm(embeds, self.enorm, eps), ops.rms_norm(features, self.hnorm, eps)], dim=-1)
        x = block.linear(x, self.eh_proj, None)
        return block.forward(input_ids, positions, kv_caches, metadata, backend, hidden_states=x)

    @torch.inference_mode()
    def draft_tokens(self, out: torch.Tensor, vocab_limit: int) -> list[int]:
        return self.block.compute_logits(out)[:, :vocab_limit].argmax(dim=-1).tolist()


@dataclass(frozen=True)
class LoadedMtp:
    head: MtpHead
    backend: AttentionBackend
    spec: KVCacheSpec
    feature_layers: tuple[int, ...] = ()  # (what the runner taps: none, the final hidden states serve)


def load_mtp_head(
    hf_config: Any,
    checkpoint_path,
    target: LlamaForCausalLM,
    numerics_for: Callable[[Any], tuple[AttentionBackend, Any, Any]],
    *,
    block_size: int,
    kv_dtype: torch.dtype,
    max_model_len: Optional[int] = None,
) -> LoadedMtp:
    """The target checkpoint's first prediction layer, on the target's device and dtype, through
    `numerics_for(its one-layer HF config)`; SettingsConflictError when the family has none served or the
    checkpoint stores none."""
    architecture = family_of(hf_config).architecture
    if architecture not in MTP_ARCHITECTURES:
        raise SettingsConflictError(
            f'--speculative-config method "mtp": {architecture} has no multi-token-prediction layer served '
            f"(served: {', '.join(MTP_ARCHITECTURES)})"
        )
    if not int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0):
        raise SettingsConflictError('--speculative-config method "mtp": the config sets no num_nextn_predict_layers')
    index = int(hf_config.num_hidden_layers)
    prefix = f"model.layers.{index}."
    layer = iter_weights(checkpoint_path, keep=lambda n: n.startswith(prefix))
    stored = {  # (an FP8 checkpoint's prediction layer is FP8 too: dequantized as the target's layers are)
        name[len(prefix) :]: tensor
        for name, tensor in fp8_checkpoint_weights(layer, hf_config, target.dtype, target.device)
    }
    names = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
    missing = [name for name in names if name not in stored]
    if missing:
        raise SettingsConflictError(
            f'--speculative-config method "mtp": the checkpoint stores no prediction layer {index} '
            f"({', '.join(prefix + name for name in missing)} missing)"
        )
    extras = {name: stored.pop(name).to(target.dtype) for name in names}
    config = copy.deepcopy(hf_config)
    config.num_hidden_layers = 1
    config.first_k_dense_replace = 0  # the prediction layer is sparse where the family's later layers are
    backend, ops, linear = numerics_for(config)
    block = build_model(config, target.dtype, target.device, ops, linear, max_model_len=max_model_len)
    weights = {("layers.0." + name): tensor for name, tensor in stored.items() if not _head_tensor(name)}
    if target.vocab_parallel is None:
        embed, lm_head = _target_matrix(target.embed, "embedding"), target.lm_head
    else:  # each rank holds a slice of the target's rows: the layer, on this one, all of them
        embed, lm_head = full_target_rows(Path(checkpoint_path), target.dtype, target.device)
    weights["embed_tokens.weight"] = embed  # (a copy is stored in the layer too: the same rows)
    weights["norm.weight"] = _pop(stored, "shared_head.norm.weight")
    head_matrix = stored.pop("shared_head.head.weight", None)
    weights["lm_head.weight"] = head_matrix if head_matrix is not None else _target_matrix(lm_head, "LM head")
    try:
        block.load_weights(weights.items())
    except ValueError as error:
        raise SettingsConflictError(f'--speculative-config method "mtp": prediction layer {index}: {error}') from error
    head = MtpHead(
        block, extras["enorm.weight"], extras["hnorm.weight"], block.linear.prepare(extras["eh_proj.weight"])
    )
    arch = block.arch
    spec = KVCacheSpec(1, block_size, arch.num_kv_heads, arch.head_dim, kv_dtype, latent_rank=latent_rank_of(config))
    logger.info("multi-token prediction: layer %d of the checkpoint drafts (%.1f MB)", index, head.weight_bytes() / 1e6)
    return LoadedMtp(head, backend, spec)


def _head_tensor(name: str) -> bool:
    return name.startswith(("shared_head.", "embed_tokens."))


def _pop(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return stored.pop(name)
    except KeyError:
        raise SettingsConflictError(f'--speculative-config method "mtp": the checkpoint lacks {name}') from None


def _target_matrix(matrix: Any, what: str) -> torch.Tensor:
    if not isinstance(matrix, torch.Tensor):
        raise SettingsConflictError(
            f'--speculative-config method "mtp": the prediction layer reads the target\'s {what}, which is stored '
            "quantized here (serve the target with float weights)"
        )
    return matrix
