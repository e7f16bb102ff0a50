"""EAGLE and EAGLE-3 draft heads: a few Llama layers that read the target's hidden states beside each token.

The head at position p reads token p + 1 and a feature of the target at position p, and its output predicts
token p + 2 (vLLM's layout, the EAGLE papers'):

    EAGLE      x = fc([embed(token); feature])            feature: the target's last hidden state, after its
               layers (the first without an input norm)   final norm (what HF's base model returns)
               out = x + residual after the last layer    logits = target's LM head (out), no norm in between
    EAGLE-3    feature = fc([h_a; h_b; h_c])              h_i: the target's residual stream entering layer i
               layer 0 attends from [input_norm(embed(token)); hidden_norm(feature)], 2 * hidden wide,
               its residual the feature itself (or its norm: `norm_before_residual`)
               out = x + residual                         logits = own LM head (norm(out)) over a draft
                                                          vocabulary, each id mapped to the target's (d2t)

A later draft position reads the head's own `out` of the position before as its feature (EAGLE-3: already
fc'd). The layers, their attention over the head's own paged KV cache and the products are Llama's
(engine/models/llama.py); the embedding (and EAGLE's LM head) are the target's.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models.llama import LlamaForCausalLM, LlamaLayerWeights

METHODS = ("eagle", "eagle3")


class EagleHead(LlamaForCausalLM):
    """An EAGLE (`method` "eagle") or EAGLE-3 ("eagle3") draft head over the `target` model's embedding."""

    def __init__(self, method: str, target: LlamaForCausalLM, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if method not in METHODS:
            raise ValueError(f"EAGLE method {method!r} unknown (one of {METHODS})")
        self.method = method
        self.target = target
        self.fused = None  # (the native decode step computes a target's layer recipe, not a head's)
        self.fc: Any = None  # [hidden, 2 * hidden] (EAGLE) or [hidden, 3 * target hidden] (EAGLE-3)
        self.fc_bias: Optional[torch.Tensor] = None
        self.hidden_norm: Optional[torch.Tensor] = None  # EAGLE-3: the feature's norm in layer 0
        self.norm_before_residual = False  # EAGLE-3: layer 0's residual is the feature after hidden_norm
        self.draft_to_target: Optional[torch.Tensor] = None  # EAGLE-3: [draft vocab] target id - draft id (d2t)
        # With tensor parallelism the target holds a slice of the vocabulary's rows: the head holds all of them,
        # read from the target's checkpoint (its embedding, and EAGLE's LM head); None: the target's serve
        self.target_rows: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    # ------------------------------------------------------------------ weights

    def load_head(self, weights: Sequence[tuple[str, torch.Tensor]], norm_before_residual: bool = False) -> None:
        """The head's tensors by their checkpoint names (EAGLE: fc, layers.*, layer 0 without an input norm;
        EAGLE-3: midlayer.* as layers.0.*, fc, norm, lm_head, d2t); its embedding is the target's (a stored
        embed_tokens, a copy of the target's, is not read) and so is EAGLE's LM head. ValueError naming what
        is missing or left over."""
        state: dict[str, Any] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("midlayer."):
                name = "layers.0." + name[len("midlayer.") :]
            if name in ("embed_tokens.weight", "t2d") or "rotary_emb" in name:
                continue  # the target's embedding serves; t2d is d2t's inverse, which greedy drafting never reads
            dtype = torch.int64 if name == "d2t" else self.dtype
            state[name] = tensor.to(dtype=dtype, device=self.device)
        eagle3 = self.method == "eagle3"
        if not eagle3:  # EAGLE's first layer reads fc's output as it is (no input norm; one stored is not read)
            state["layers.0.input_layernorm.weight"] = torch.ones(self.arch.hidden_size, dtype=self.dtype)
        if eagle3:
            self.hidden_norm = _pop(state, "layers.0.hidden_norm.weight")
            self.norm_before_residual = norm_before_residual
        self.layers = [self._take_layer(state, i) for i in range(self.arch.num_layers)]
        self.fc = self.linear.prepare(_pop(state, "fc.weight"))
        self.fc_bias = state.pop("fc.bias", None)
        if eagle3:
            self.final_norm = _pop(state, "norm.weight")
            self.lm_head = self.linear.prepare(_pop(state, "lm_head.weight"))
            self.draft_to_target = state.pop("d2t", None)  # (absent: the head drafts over the target's vocabulary)
        if state:
            raise ValueError(f"{len(state)} tensors of the EAGLE head were not used: {', '.join(sorted(state)[:8])}")

    def weight_bytes(self) -> int:
        own = [t for t in (self.fc, self.fc_bias, self.hidden_norm, self.final_norm, self.lm_head) if t is not None]
        layers = [getattr(layer, name) for layer in self.layers for name in LlamaLayerWeights.__slots__]
        return sum(t.numel() * t.element_size() for t in [*own, *layers] if isinstance(t, torch.Tensor))

    # ------------------------------------------------------------------ forward

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features of some positions [n, width] -> what the head reads as its feature [n, hidden]:
        EAGLE-3's three layers' states through fc; EAGLE's final hidden states as they are."""
        if self.method == "eagle3":
            return self.linear(features.to(self.dtype), self.fc, self.fc_bias)
        return features.to(self.dtype)

    @torch.inference_mode()
    def forward_head(
        self,
        input_ids: torch.Tensor,  # [T]: token p + 1 at each row
        positions: torch.Tensor,  # [T]: p
        features: torch.Tensor,  # [T, hidden]: the combined feature of position p
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: Sequence[AttentionMetadata],
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]: `out`, each row's logits' input and the next position's feature
        ops, eps = self.ops, self.arch.rms_norm_eps
        angles = ops.rotary_angles(positions, self.rotary)
        # the embedding's rows as stored: not a target's own scaling of them (Gemma's sqrt(hidden), Granite's
        # multiplier), which its forward applies and a head's training never saw (vLLM shares the module alone)
        if self.target_rows is None:
            embeds = LlamaForCausalLM.embed_tokens(self.target, input_ids)
        else:
            embeds = F.embedding(input_ids, self.target_rows[0])
        if self.method == "eagle3":
            assert self.hidden_norm is not None
            normed = ops.rms_norm(features, self.hidden_norm, eps)
            residual = normed if self.norm_before_residual else features
            x = torch.cat([ops.rms_norm(embeds, self.layers[0].input_norm, eps), normed], dim=-1)
        else:
            x = residual = self.linear(torch.cat([embeds, features], dim=-1), self.fc, self.fc_bias)
        h = torch.zeros_like(residual)  # (the first layer reads x as built above)
        for index, (layer, (key_cache, value_cache), step) in enumerate(zip(self.layers, kv_caches, metadata)):
            if index:
                x, residual = ops.add_rms_norm(h, residual, layer.input_norm, eps)
            h = self._attention(layer, x, angles, key_cache, value_cache, step, backend, self.layer_attention[index])
            x, residual = ops.add_rms_norm(h, residual, layer.post_norm, eps)
            h = self._mlp(index, layer, x)
        return residual + h

    @torch.inference_mode()
    def draft_tokens(self, out: torch.Tensor, vocab_limit: int) -> list[int]:
        """The greedy next token (a target id below `vocab_limit`) of each row of `out` [n, hidden]."""
        if self.method == "eagle" and self.target_rows is not None:
            logits = F.linear(out, self.target_rows[1]).float()
            return logits[:, :vocab_limit].argmax(dim=-1).tolist()
        if self.method == "eagle":
            logits = self.target.head_logits(out)  # the target's LM head on the head's output, no norm between
            return logits[:, :vocab_limit].argmax(dim=-1).tolist()
        logits = self.linear(self.final_hidden(out), self.lm_head, None).float()  # [n, draft vocab]
        draft_ids = logits.argmax(dim=-1)
        if self.draft_to_target is not None:
            draft_ids = draft_ids + self.draft_to_target[draft_ids]
        return draft_ids.clamp(max=vocab_limit - 1).tolist()


def _pop(state: dict[str, Any], name: str) -> Any:
    try:
        return state.pop(name)
    except KeyError:
        raise ValueError(f"the EAGLE head's checkpoint lacks {name}") from None
