"""The generic decoder: Llama's weights and attention call, the layer recipe read from a DecoderArch.

    per layer   x = norm_attn_pre(h)?                      (each norm only where the arch has it, RMSNorm or
                h = h + residual_scale * norm_attn_post(attention(x))?     LayerNorm as `norm_kind` says)
                x = norm_mlp_pre(h)?
                h = h + residual_scale * norm_mlp_post(down(act(gate(x)) * up(x)))?   (plain MLP: down(act(up(x))))
                                                           (a sparse layer's MLP: its experts, models/decoder_moe.py)
    parallel    x = norm_attn_pre(h)                       (`parallel_branches`: Cohere, Phi-2)
                h = h + attention(x) + mlp(x)              (each scaled and post-normed as above; with an
                                                           mlp_pre norm: mlp(norm_mlp_pre(h)), GPT-NeoX)
    logits      cap((lm_head(final_norm(h)) + lm_head_bias?) / logits_divisor * logits_scale)

Attention rotates q and k by the layer's RoPE, or not at all where `layer_rope` names none (Cohere 2's global
layers); Llama 4 normalises each head's rotated q and k without a weight, and scales its NoPE layers' queries by
position (attention temperature tuning). The fused CPU decode step (engine/layers/fused_decode.py) computes this
recipe too, for each family whose norms are RMSNorms, whose MLP is gated, whose branches run in sequence and whose
every layer has RoPE (`fused_recipe`), without Llama 4's additions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.layer_attention import LayerAttention
from engine.distributed.parallel_group import ParallelGroup
from engine.distributed.pipeline_stage import PipelineStage
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.layers.mrope import SectionedRows
from engine.layers.rotary import RotaryEmbedding
from engine.models.checkpoint_names import checkpoint_rows
from engine.models.decoder_arch import DecoderArch
from engine.models.llama import LlamaForCausalLM, layer_tensors
from engine.profiling.memory_bandwidth import tensor_bytes
from engine.quantization.int8_weight import Int8Weight
from engine.quantization.weight_quantizer import WeightQuantizer


@dataclass(slots=True)
class DecoderLayerWeights:
    norms: dict[str, torch.Tensor]  # role (NORM_ROLES) -> [hidden]
    norm_biases: dict[str, torch.Tensor]  # role -> [hidden]: a LayerNorm's shift (DecoderArch.norm_bias)
    qkv: Any  # [(heads + 2 * kv_heads) * head_dim, hidden]; projections as the Linear prepared them
    qkv_bias: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]  # [head_dim] per head ([heads, head_dim]: each its own), or [heads * head_dim]
    k_norm: Optional[torch.Tensor]
    o_proj: Any  # [hidden, heads * head_dim]
    o_bias: Optional[torch.Tensor]
    # [2 * intermediate, hidden]; a plain MLP's up (StarCoder2's c_fc) [intermediate, hidden]; None: the layer's MLP
    # is a mixture of experts (models/decoder_moe.py)
    gate_up: Any
    gate_up_bias: Optional[torch.Tensor]
    down: Any  # [hidden, intermediate]
    down_bias: Optional[torch.Tensor]
    q_norm_bias: Optional[torch.Tensor] = None  # [head_dim]: per-head q/k LayerNorms' shifts (Phi-2's q_layernorm)
    k_norm_bias: Optional[torch.Tensor] = None
    # [4] in the model's dtype: xIELU's softplus(alpha_p), beta + softplus(alpha_n), beta, eps (Apertus: each layer's
    # own, computed once at load in the dtype HF computes them in on every forward, so the values are HF's)
    act_params: Optional[torch.Tensor] = None

    @property
    def input_norm(self) -> Optional[torch.Tensor]:
        """The norm before attention, by the name Llama's layer (and the fused decode step) gives it."""
        return self.norms.get("attn_pre")

    @property
    def post_norm(self) -> Optional[torch.Tensor]:
        """The norm before the MLP, by Llama's name."""
        return self.norms.get("mlp_pre")

    @property
    def attn_post_norm(self) -> Optional[torch.Tensor]:
        """The norm of the attention's output before it is added (OLMo 2, Gemma)."""
        return self.norms.get("attn_post")

    @property
    def mlp_post_norm(self) -> Optional[torch.Tensor]:
        """The norm of the MLP's output before it is added."""
        return self.norms.get("mlp_post")


class DecoderForCausalLM(LlamaForCausalLM):
    """The generic decoder's families (models/families.py; Gemma, Phi-3, OLMo, Granite, Cohere, GLM-4, ...): the
    forward pass of `DecoderArch`'s recipe (with mixture-of-experts layers: OLMoE, Granite MoE, Phi-3.5-MoE,
    Llama 4, models/decoder_moe.py)."""

    arch: DecoderArch
    layers: list[DecoderLayerWeights]  # type: ignore[assignment]  # its own layers: norms by role

    def __init__(
        self,
        arch: DecoderArch,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        max_model_len: Optional[int] = None,
        tp: ParallelGroup = ParallelGroup.single(),
    ):
        super().__init__(arch, dtype, device, ops, linear, quantizer, max_model_len, tp)
        # each layer's attention as the family reads it (its scale: Granite's attention_multiplier, Gemma's
        # query_pre_attn_scalar), not Llama's
        self.layer_attention = tuple(attention.within(max_model_len) for attention in arch.layer_attention)
        self.scale = self.layer_attention[0].scale
        self.residual_scale = arch.residual_scale
        self.qk_norm_projection = arch.qk_norm == "projection"
        self.rotaries = [self.rotary] + [self._rotary(theta, scaling) for theta, scaling in arch.ropes[1:]]
        # each held layer's index in `rotaries` (None: no RoPE), by the index the layer loop counts (a stage's own)
        self.layer_rope: tuple[Optional[int], ...] = arch.layer_rope
        self.activation = arch.activation
        # what the fused decode step does not compute: LayerNorms, branches side by side, layers without RoPE
        self.fused_recipe = (
            arch.norm_kind == "rms"
            and arch.plain_mlp is None
            and not arch.parallel_branches
            and arch.positional_layers
            and not arch.learned_positions
            and arch.fused_attention
        )
        if arch.learned_positions and max_model_len is not None and max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"{arch.architecture}: max_model_len {max_model_len} is past its {arch.max_position_embeddings} "
                "learned positions"
            )
        self.embed_positions: Optional[torch.Tensor] = None  # [max_positions, hidden]: learned_positions
        self.final_norm_bias: Optional[torch.Tensor] = None  # [hidden]: the final LayerNorm's shift (norm_bias)
        self.lm_head_bias: Optional[torch.Tensor] = None  # [vocab]: the LM head's (set at load where the arch has it)
        self.embedding_scale = arch.embedding_scale
        if arch.embedding_scale is not None and arch.embedding_scale_in_dtype:
            self.embedding_scale = float(torch.tensor(arch.embedding_scale, dtype=dtype))

    def _rotary(self, theta: float, scaling: Optional[dict], rotary_dim: Optional[int] = None) -> RotaryEmbedding:
        return super()._rotary(theta, scaling, self.arch.rotary_dim)  # Phi-4-mini: the first dimensions only

    @property
    def qk_norms_as_loaded(self) -> bool:
        # this recipe applies them only where the arch names them
        return self.arch.qk_norm is not None or all(
            layer.q_norm is None and layer.k_norm is None for layer in self.layers
        )

    def hold_stage(self, stage: PipelineStage) -> None:
        """Llama's stage, and each held layer's RoPE (`layer_rope`, read by the stage's own layer index)."""
        super().hold_stage(stage)
        self.layer_rope = self.arch.layer_rope[stage.layers.start : stage.layers.stop]

    def rotary_of(self, layer: int) -> Optional[RotaryEmbedding]:
        rope = self.layer_rope[layer]
        return None if rope is None else self.rotaries[rope]

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        weights = self._folded(weights) if self.arch.norm_offset else self._plain(weights)
        super().load_weights(checkpoint_rows(weights, self.arch))

    def _plain(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The checkpoint's tensors, refusing pre-quantized storage (AWQ groups, GGUF blocks): the Llama family's.
        (int8 matrices pass: a tensor-parallel rank's row-parallel shards, quantized whole by the loader.)"""
        for name, tensor in weights:
            if isinstance(tensor, Int8Weight) or (
                isinstance(tensor, list) and all(isinstance(part, Int8Weight) for part in tensor)
            ):  # (a list: stacked experts' downs, tensor_parallel._stacked_experts)
                yield name, tensor
                continue
            if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
                raise ValueError(
                    f"{self.arch.architecture}: {name} is stored as {type(tensor).__name__}; "
                    "pre-quantized checkpoints are served for the Llama family only"
                )
            yield name, tensor

    def _folded(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Gemma's norms scale by (1 + w): w + 1, in float32 before any rounding to the model's dtype."""
        unfolded = self.arch.unfolded
        for name, tensor in self._plain(weights):
            folds = name.endswith("norm.weight") and not (unfolded and name.endswith(unfolded))
            yield name, (tensor.float() + 1.0 if folds else tensor)

    def _take_layer(self, state: dict, index: int) -> DecoderLayerWeights:  # type: ignore[override]
        take, maybe = layer_tensors(state, index)

        attn = "self_attn."
        parts = (
            ("q_proj", "k_proj", "v_proj", "gate_proj") if self.arch.attention_gate else ("q_proj", "k_proj", "v_proj")
        )
        qkv_parts = tuple(attn + name for name in parts)
        prepare = self._prepare
        norms = self.arch.norms
        return DecoderLayerWeights(
            norms={role: take(name + ".weight") for role, name in norms},
            norm_biases={role: take(name + ".bias") for role, name in norms} if self.arch.norm_bias else {},
            qkv=prepare(_fused(take, maybe, attn + "qkv_proj", qkv_parts)),
            qkv_bias=_fused_bias(maybe, attn + "qkv_proj", qkv_parts),
            q_norm=maybe(attn + "q_norm.weight"),
            k_norm=maybe(attn + "k_norm.weight"),
            o_proj=prepare(take(attn + "o_proj.weight")),
            o_bias=maybe(attn + "o_proj.bias"),
            **self._take_mlp(index, take, maybe, self._cat_rows),
            q_norm_bias=maybe(attn + "q_norm.bias"),
            k_norm_bias=maybe(attn + "k_norm.bias"),
        )

    def _take_mlp(self, index: int, take, maybe, cat) -> dict:
        """The dense MLP's fields of layer `index`: gated (gate_proj and up_proj, or Phi-3's gate_up_proj;
        down_proj) or plain (`plain_mlp`); a mixture of experts takes a sparse layer's own (models/moe.py)."""
        mlp = "mlp."
        if self.arch.plain_mlp is None:
            gate_up_parts = (mlp + "gate_proj", mlp + "up_proj")
            gate_up = _fused(take, maybe, mlp + "gate_up_proj", gate_up_parts)
            gate_up_bias = _biases(maybe, gate_up_parts)
            down_name = mlp + "down_proj"
        else:  # StarCoder2's c_fc, c_proj
            up_name, down_name = (mlp + name for name in self.arch.plain_mlp)
            gate_up, gate_up_bias = take(up_name + ".weight"), maybe(up_name + ".bias")
        fields = dict(
            gate_up=self._prepare(gate_up),
            gate_up_bias=gate_up_bias,
            down=self._prepare(take(down_name + ".weight")),
            down_bias=maybe(down_name + ".bias"),
        )
        if self.arch.activation == "xielu":
            alpha_p, alpha_n, beta, eps = (take(f"{mlp}act_fn.{name}").reshape(()) for name in XIELU_PARAMS)
            fields["act_params"] = torch.stack([F.softplus(alpha_p), beta + F.softplus(alpha_n), beta, eps])
        return fields

    def weight_bytes(self) -> int:
        by_role = ("norms", "norm_biases")
        fields = [
            getattr(layer, name)
            for layer in self.layers
            for name in DecoderLayerWeights.__slots__
            if name not in by_role
        ]
        norms = [norm for layer in self.layers for kind in (layer.norms, layer.norm_biases) for norm in kind.values()]
        ends = [
            self.embed,
            self.embed_positions,
            self.final_norm,
            self.final_norm_bias,
            self.lm_head,
            self.lm_head_bias,
        ]
        ends = [t for t in ends if t is not None]
        return tensor_bytes([*ends, *fields, *norms])

    def _take_ends(self, state: dict[str, Any]) -> None:
        # (without norm_bias a stored norm.bias stays unused, and load_weights refuses it by name)
        if self.arch.learned_positions:
            if "embed_positions.weight" not in state:
                raise ValueError("checkpoint lacks embed_positions.weight")
            self.embed_positions = state.pop("embed_positions.weight")
        if self.arch.norm_bias:
            if "norm.bias" not in state:
                raise ValueError("checkpoint lacks norm.bias")
            self.final_norm_bias = state.pop("norm.bias")
        if self.arch.lm_head_bias:
            # a pooling model serves no LM head: its bias, where the checkpoint has one, is not read
            bias = state.pop("lm_head.bias", None)
            if bias is None and self.keeps_lm_head:
                raise ValueError("checkpoint lacks lm_head.bias")
            self.lm_head_bias = bias if self.keeps_lm_head else None
        super()._take_ends(state)

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: Sequence[AttentionMetadata],  # each layer's (its KV group's)
        backend: AttentionBackend,
        hidden_states: Optional[torch.Tensor] = None,
        sectioned: Optional[SectionedRows] = None,
    ) -> torch.Tensor:  # [num_tokens, hidden], before the final norm
        # `hidden_states`: the first layer's input given: a pipeline stage's after the first (the stage before's
        # residual stream, what its next layer reads: the embeddings' scale and learned positions were added on
        # stage 0, which alone holds them), or a vision-language model's step with image rows
        if sectioned is not None:  # (mrope_section is read for the Llama family's configs only: Qwen2-VL's)
            raise ValueError(f"{type(self).__name__} does not rotate by multimodal RoPE")
        if hidden_states is None and self._fuses(input_ids, metadata, kv_caches, backend):
            assert self.fused is not None
            return self.fused.forward(self, input_ids, positions, kv_caches, metadata)
        arch, ops = self.arch, self.ops
        angles = [ops.rotary_angles(positions, rotary) for rotary in self.rotaries]
        query_scales = None if arch.temperature_tuning is None else _temperature_scales(positions, arch)
        h = self.input_embeddings(input_ids) if hidden_states is None else hidden_states  # [num_tokens, hidden]
        if self.embed_positions is not None:  # (HF adds them to whatever embeddings enter the first layer)
            h = h + self.embed_positions[positions]
        taps, tapped = self.feature_layers, self.tapped_features
        recurrent = self.recurrent_layers
        caches = iter(zip(kv_caches, metadata, strict=True))  # the attention layers', in their order
        for index, layer in enumerate(self.layers):
            if index in taps:
                tapped[index] = h  # the stream entering this layer (EAGLE-3's features; never written in place here)
            x = self._norm(h, layer, "attn_pre")
            if index in recurrent:  # a hybrid model's recurrent layer (models/hybrid.py): no KV cache
                attended = self._recurrent_mix(index, x)
            else:
                rope = self.layer_rope[index]
                (key_cache, value_cache), step = next(caches)
                attended = self._layer_attention(
                    layer,
                    x,
                    None if rope is None else self.rotaries[rope],
                    None if rope is None else angles[rope],
                    key_cache,
                    value_cache,
                    step,
                    backend,
                    self.layer_attention[index],
                    index,
                    query_scales if rope is None else None,
                )
            attended = self._norm(attended, layer, "attn_post")
            if arch.parallel_branches:  # both read x (GPT-NeoX's MLP its own norm of h); HF's order: (h + attn) + mlp
                mlp_input = self._norm(h, layer, "mlp_pre") if "mlp_pre" in layer.norms else x
                mlp = self._mlp_branch(index, layer, mlp_input)
                h = self._add(self._add(h, attended), self._norm(mlp, layer, "mlp_post"))
            else:
                h = self._add(h, attended)
                mlp = self._mlp_branch(index, layer, self._norm(h, layer, "mlp_pre"))
                h = self._add(h, self._norm(mlp, layer, "mlp_post"))
        return h

    recurrent_layers: frozenset[int] = frozenset()
    """The layers whose token mixer is a recurrent layer (Mamba-2, a short convolution, linear attention), not
    attention (a hybrid model's: models/hybrid.py)."""

    def _recurrent_mix(self, index: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no recurrent layers")

    def _mlp_branch(self, index: int, layer: DecoderLayerWeights, x: torch.Tensor) -> torch.Tensor:
        """Layer `index`'s MLP of x [T, hidden] (normed), all-reduced over the ranks."""
        return self.tp.all_reduce(self._mlp(index, layer, x))  # (each rank's partial sums)

    def _mlp(self, index: int, layer: DecoderLayerWeights, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """The dense MLP of x [T, hidden]: a partial sum with several ranks (a sparse layer's experts:
        models/moe.py's `_mlp`, by the MRO of models/decoder_moe.py)."""
        lora = self.lora_step
        gate_up = self.linear(x, layer.gate_up, layer.gate_up_bias)
        if lora is not None:
            lora.add(index, "gate_up", x, gate_up)
        act = self._activate(gate_up, layer.act_params)
        out = self.linear(act, layer.down, layer.down_bias)
        if lora is not None:
            lora.add(index, "down", act, out)
        return out

    def input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings as the first layer takes them, a LoRA adapter's replacement rows scaled as the base's
        (HF scales whatever the embedding module returns)."""
        return self._scaled(self._adapter_rows(input_ids, super().embed_tokens(input_ids)))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings as the first layer takes them: times `embedding_scale` (Gemma, Granite)."""
        return self._scaled(super().embed_tokens(input_ids))

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.embedding_scale is None else h * self.embedding_scale

    def _norm(self, x: torch.Tensor, layer: DecoderLayerWeights, role: str) -> torch.Tensor:
        weight = layer.norms.get(role)
        return x if weight is None else self._normalize(x, weight, layer.norm_biases.get(role))

    def _normalize(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, width] through the arch's kind of norm (an RMSNorm's weight only; a LayerNorm's and its shift)."""
        if self.arch.norm_kind == "layer":
            return self.ops.layer_norm(x, weight, bias, self.arch.rms_norm_eps)
        return self.ops.rms_norm(x, weight, self.arch.rms_norm_eps)

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, heads * head_dim] normalized over each head's dimensions: a weight shared by the heads
        [head_dim], or each head's own [heads, head_dim] (Cohere's LayerNorms); a LayerNorm's shift (Phi-2's)."""
        head_dim = self.arch.head_dim
        if self.arch.norm_kind == "layer":
            return self.ops.layer_norm(x.reshape(x.shape[0], -1, head_dim), weight, bias, self.arch.rms_norm_eps)
        return self.ops.rms_norm(x.reshape(-1, head_dim), weight, self.arch.rms_norm_eps)

    def _add(self, residual: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        scale = self.residual_scale
        return residual + (branch if scale == 1.0 else branch * scale)

    def _activate(self, gate_up: torch.Tensor, params: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.arch.plain_mlp is not None:  # no gate: the activation of all of up's output
            if self.arch.activation == "relu2":  # Arcee's: relu(x)^2, as HF's ReLUSquaredActivation
                return torch.square(F.relu(gate_up))
            if self.arch.activation == "xielu":
                assert params is not None  # (the loader took the layer's)
                return _xielu(gate_up, params)
            if self.arch.activation == "silu":
                return F.silu(gate_up)
            return F.gelu(gate_up, approximate="tanh" if self.arch.activation == "gelu_tanh" else "none")
        if self.arch.activation == "silu":
            return self.ops.silu_and_mul(gate_up)
        return self.ops.gelu_tanh_and_mul(gate_up)

    def _layer_attention(
        self,
        layer: DecoderLayerWeights,
        x,
        rotary: Optional[RotaryEmbedding],  # None: the layer has no positional embedding
        angles,
        key_cache,
        value_cache,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        attention: LayerAttention,
        index: int,
        query_scales: Optional[torch.Tensor] = None,  # [T] float32: each query's multiplier (temperature tuning)
    ) -> torch.Tensor:
        """Layer `index`'s attention block (the index selects its LoRA deltas)."""
        arch, ops, lora = self.arch, self.ops, self.lora_step
        num_tokens = x.shape[0]
        heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        qkv = self.linear(x, layer.qkv, layer.qkv_bias)  # [T, (heads + 2 kv_heads) * head_dim]
        if lora is not None:
            lora.add(index, "qkv", x, qkv)
        q, k = qkv[:, : arch.q_size], qkv[:, arch.q_size : arch.q_size + arch.kv_size]
        if arch.qk_norm is not None and arch.qk_norm != "l2":
            q_norm, k_norm = layer.q_norm, layer.k_norm
            assert q_norm is not None and k_norm is not None  # an arch with q/k norms: the loader took both
            if arch.qk_norm == "projection":  # over all heads at once, before they are split
                q, k = self._projection_norm(q, q_norm), self._projection_norm(k, k_norm)
            else:  # "head": each head's
                q, k = self._head_norm(q, q_norm, layer.q_norm_bias), self._head_norm(k, k_norm, layer.k_norm_bias)
        qk = torch.cat([q.reshape(num_tokens, heads, head_dim), k.reshape(num_tokens, kv_heads, head_dim)], dim=1)
        if rotary is not None:
            qk = ops.rotary(qk, angles, rotary)
            if arch.qk_norm == "l2":  # (Llama 4: after RoPE, and on the layers that rotate only)
                qk = _l2_norm(qk, arch.rms_norm_eps)
        query, key = qk[:, :heads], qk[:, heads:]
        if query_scales is not None:  # (HF: the product in float32, rounded to the model's dtype)
            query = (query * query_scales[:, None, None]).to(qk.dtype)
        value = qkv[:, arch.q_size + arch.kv_size : arch.q_size + 2 * arch.kv_size].view(num_tokens, kv_heads, head_dim)
        backend.write_kv(key, value, key_cache, value_cache, metadata)
        out = backend.attend(query, key, value, key_cache, value_cache, metadata, attention)
        out = out.reshape(num_tokens, heads * head_dim)
        if arch.attention_gate:  # (Qwen3.5: in the model's dtype, as transformers multiplies)
            out = out * torch.sigmoid(qkv[:, arch.q_size + 2 * arch.kv_size :])
        projected = self.linear(out, layer.o_proj, layer.o_bias)
        if lora is not None:
            lora.add(index, "o_proj", out, projected)
        # (with several ranks: partial sums, all-reduced before the post-norm that Gemma and OLMo 2 apply to them)
        return self.tp.all_reduce(projected)

    def _projection_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over a whole q or k projection (OLMo 2) [T, width]. With several ranks each holds its heads'
        columns: the mean square is the all-reduced sum of squares over every rank's width. Replicated KV heads
        (fewer than ranks) count as often in both, so the mean is the whole projection's still."""
        tp = self.tp
        if not tp.is_parallel:
            return self.ops.rms_norm(x, weight, self.arch.rms_norm_eps)
        x32 = x.float()
        squares = tp.all_reduce(x32.pow(2).sum(dim=-1, keepdim=True))  # [T, 1]
        mean = squares / (x.shape[-1] * tp.world_size)
        return (weight * (x32 * torch.rsqrt(mean + self.arch.rms_norm_eps))).to(x.dtype)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._normalize(hidden, self.final_norm, self.final_norm_bias)

    @torch.inference_mode()
    def compute_logits(
        self, hidden: torch.Tensor, lm_heads: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
    ) -> torch.Tensor:
        """hidden [n, hidden] (rows to sample) -> logits [n, vocab] in float32 (`lm_heads`: LoRA adapters'
        replacement LM heads, whose logits take the family's bias, scales and cap as the base's do)."""
        logits = super().compute_logits(hidden, lm_heads)
        if self.lm_head_bias is not None:  # (the whole vocabulary's on every rank: added to the gathered logits)
            logits = logits + self.lm_head_bias.float()
        if self.arch.logits_divisor != 1.0:
            logits = logits / self.arch.logits_divisor
        if self.arch.logits_scale != 1.0:
            logits = logits * self.arch.logits_scale
        cap = self.arch.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, heads, head_dim] over each head's dimensions, without weight, in float32 (HF's
    Llama4TextWeightlessRMSNorm, operation for operation)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _temperature_scales(positions: torch.Tensor, arch: DecoderArch) -> torch.Tensor:
    """[T] float32: Llama 4's query multiplier at each position (its NoPE layers' attention temperature tuning),
    computed as HF computes it."""
    assert arch.temperature_tuning is not None
    floor_scale, attn_scale = arch.temperature_tuning
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


XIELU_PARAMS = ("alpha_p", "alpha_n", "beta", "eps")
"""An xIELU activation's tensors in the checkpoint (mlp.act_fn.*: Apertus), in the order `_xielu` reads them."""


def _xielu(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """xIELU of x [T, width] as transformers' XIELUActivation computes it in Python (its CUDA kernel is optional),
    operation for operation in x's dtype: params [4] as `_take_mlp` derives them from the checkpoint."""
    alpha_p, alpha_n, beta, eps = params[0:1], params[1:2], params[2], params[3]
    return torch.where(
        x > 0,
        alpha_p * x * x + beta * x,
        (torch.expm1(torch.minimum(x, eps)) - x) * alpha_n + beta * x,
    )


def _fused(take, maybe, name: str, parts: tuple[str, ...]) -> torch.Tensor:
    """A fused projection as stored (Phi-3's qkv_proj, gate_up_proj), else its parts stacked."""
    whole = maybe(name + ".weight")
    return whole if whole is not None else torch.cat([take(part + ".weight") for part in parts]).contiguous()


def _fused_bias(maybe, name: str, parts: tuple[str, ...]) -> Optional[torch.Tensor]:
    """A fused projection's bias as stored (GPT-NeoX's query_key_value, renamed qkv_proj), else its parts'."""
    whole = maybe(name + ".bias")
    return whole if whole is not None else _biases(maybe, parts)


def _biases(maybe, parts: tuple[str, ...]) -> Optional[torch.Tensor]:
    """The parts' biases stacked (None: none has one)."""
    found = [maybe(part + ".bias") for part in parts]
    present = [bias for bias in found if bias is not None]
    if not present:
        return None
    if len(present) < len(found):
        raise ValueError(f"checkpoint has biases for some of {', '.join(parts)} only")
    return torch.cat(present).contiguous()
