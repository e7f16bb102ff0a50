"""DeepSeek-V2/V3: multi-head latent attention over a latent KV cache (engine/layers/latent_attention.py) and a
mixture of experts with shared experts and grouped routing (engine/layers/grouped_routing.py) in every sparse
layer, dense MLPs in the first ones.

Checkpoints as `save_pretrained` writes them: `self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj},
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj`, `mlp.gate.weight` (+ `e_score_correction_bias`, V3),
`mlp.experts.N.{gate,up,down}_proj` (or stacked), `mlp.shared_experts.{gate,up,down}_proj`. Layers past
num_hidden_layers (V3's multi-token-prediction layer, which engine/spec_decode/mtp.py reads) are not read. Where
the rotary pairs are interleaved, the rope rows of the q and k_pe projections are reordered at load into the two
halves the rotary embedding turns (the same products, so the same scores).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from engine.attention.layer_attention import LayerAttention
from engine.distributed.parallel_group import ParallelGroup
from engine.layers.latent_attention import LatentAttentionWeights, latent_attention, split_kv_b
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.layers.moe import SharedExpert, SparseMoeBlock, relu_squared
from engine.layers.rotary import RotaryEmbedding
from engine.layers.grouped_routing import GroupedTopK
from engine.models.llama import layer_tensors
from engine.models.deepseek_arch import DeepseekArch
from engine.models.llama_arch import LlamaArch
from engine.models.moe import MoeForCausalLM, _cat_rows, _float
from engine.profiling.memory_bandwidth import tensor_bytes
from engine.quantization.weight_quantizer import WeightQuantizer

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.(.*)")


@dataclass(slots=True)
class DeepseekLayerWeights:
    input_norm: torch.Tensor  # [hidden]
    attention: LatentAttentionWeights
    post_norm: torch.Tensor  # [hidden]
    gate_up: Optional[torch.Tensor]  # [2 * intermediate, hidden]; None: the layer is a mixture of experts
    gate_up_bias: Optional[torch.Tensor]
    down: Optional[torch.Tensor]  # [hidden, intermediate]
    down_bias: Optional[torch.Tensor]


class DeepseekForCausalLM(MoeForCausalLM):
    """The Llama-family forward pass (norms, residuals, the MoE blocks of `MoeForCausalLM`) with latent attention."""

    quantized_experts = False  # its experts and latent attention load as floats only

    layers: list[DeepseekLayerWeights]  # type: ignore[assignment]  # its own layers' fields (LlamaLayerWeights' norms)

    def __init__(
        self,
        arch: LlamaArch,
        deepseek: DeepseekArch,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        max_model_len: Optional[int] = None,
        tp: ParallelGroup = ParallelGroup.single(),
    ):
        """With several ranks `arch` and `deepseek` are this rank's share (registry.build_model): its query heads,
        each expert's share of the width; the latent and the cache it fills are the same on every rank."""
        super().__init__(arch, deepseek.moe, dtype, device, ops, linear, quantizer, tp, max_model_len)
        mla = deepseek.mla
        self.mla = mla
        self.routing = deepseek.routing
        # the rope part of each head only (arch.head_dim is the cache entry's width, kv_lora_rank + rope)
        self.rotary = RotaryEmbedding(
            mla.qk_rope_head_dim,
            arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
            dtype,
            device,
            max_model_len=max_model_len,
        )
        self.scale = mla.softmax_scale
        self.layer_attention = (LayerAttention(mla.softmax_scale, latent_rank=mla.kv_lora_rank),) * arch.num_layers

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights) -> None:
        super().load_weights(self._arranged(weights))

    def _arranged(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The checkpoint's tensors less the layers past num_hidden_layers, interleaved rope rows in halves."""
        for name, tensor in weights:
            match = _LAYER.fullmatch(name)
            if match is not None and int(match.group(1)) >= self.arch.num_layers:
                continue  # V3's multi-token-prediction layer: not a layer of the causal LM
            if not self._held(name.removeprefix("model.")):
                continue  # another pipeline stage's (its rope rows left as they are)
            if match is not None and self.mla.rope_interleaved:
                tensor = self._rope_halves(match.group(2), tensor)
            yield name, tensor

    def _rope_halves(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Rows (x0, x1, x2, x3, ...) of a rope part reordered to (x0, x2, ..., x1, x3, ...)."""
        mla = self.mla
        rope = mla.qk_rope_head_dim
        order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        if name in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"):
            per_head = tensor.view(mla.num_heads, mla.qk_head_dim, -1)
            nope = per_head[:, : mla.qk_nope_head_dim]
            return torch.cat([nope, per_head[:, mla.qk_nope_head_dim :][:, order]], dim=1).view(tensor.shape)
        if name in ("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias"):
            return torch.cat([tensor[: mla.kv_lora_rank], tensor[mla.kv_lora_rank :][order]])
        return tensor

    def _take_layer(self, state: dict, index: int) -> DeepseekLayerWeights:  # type: ignore[override]
        take, maybe = layer_tensors(state, index)

        def cat(*tensors: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if tensors[0] is None else torch.cat(tensors, dim=0).contiguous()  # type: ignore[arg-type]

        return DeepseekLayerWeights(
            input_norm=take("input_layernorm.weight"),
            attention=self._take_attention(take, maybe),
            post_norm=take("post_attention_layernorm.weight"),
            **self._take_mlp(index, take, maybe, cat),
        )

    def _take_attention(self, take, maybe) -> LatentAttentionWeights:
        mla, a = self.mla, "self_attn."
        q_name = a + ("q_proj" if mla.q_lora_rank is None else "q_a_proj")
        q, kv_a = _float(take(q_name + ".weight")), _float(take(a + "kv_a_proj_with_mqa.weight"))
        q_bias, kv_bias = maybe(q_name + ".bias"), maybe(a + "kv_a_proj_with_mqa.bias")
        bias = None
        if q_bias is not None or kv_bias is not None:  # attention_bias: q_proj has none, q_a_proj and kv_a_proj have
            bias = torch.cat(
                [
                    q.new_zeros(q.shape[0]) if q_bias is None else q_bias,
                    kv_a.new_zeros(kv_a.shape[0]) if kv_bias is None else kv_bias,
                ]
            )
        w_uk, w_uv = split_kv_b(_float(take(a + "kv_b_proj.weight")), mla.num_heads, mla.qk_nope_head_dim)
        low_rank = mla.q_lora_rank is not None
        return LatentAttentionWeights(
            qkv_a=self._prepare(_cat_rows(q, kv_a)),
            qkv_a_bias=bias,
            q_a_norm=take(a + "q_a_layernorm.weight") if low_rank else None,
            q_b=self._prepare(_float(take(a + "q_b_proj.weight"))) if low_rank else None,
            kv_a_norm=take(a + "kv_a_layernorm.weight"),
            w_uk=w_uk,
            w_uv=w_uv,
            o_proj=self._prepare(_float(take(a + "o_proj.weight"))),
            o_bias=maybe(a + "o_proj.bias"),
        )

    def _take_block(self, take, maybe, cat) -> SparseMoeBlock:
        return grouped_experts_block(self, self.routing, take, maybe, cat)

    def weight_tensors(self) -> list[torch.Tensor]:
        dense = [
            w
            for layer in self.layers
            for w in (*layer.attention.matrices(), layer.gate_up, layer.down)
            if w is not None
        ]
        experts = [m for block in self.moe_blocks.values() for m in block.matrices()]
        return dense + experts + ([self.lm_head] if self.lm_head is not None else [])  # (a stage without the head)

    def weight_bytes(self) -> int:
        attention = [
            getattr(layer.attention, name) for layer in self.layers for name in LatentAttentionWeights.__slots__
        ]
        fields = [
            getattr(layer, name)
            for layer in self.layers
            for name in DeepseekLayerWeights.__slots__
            if name != "attention"
        ]
        blocks = [t for block in self.moe_blocks.values() for t in block.tensors()]
        return tensor_bytes([self.embed, self.final_norm, self.lm_head, *attention, *fields, *blocks])

    # ------------------------------------------------------------------ forward

    def _attention(
        self, layer, x, angles, key_cache, value_cache, metadata, backend, attention, index: int = 0, rotary=None
    ) -> torch.Tensor:
        return latent_attention(
            layer.attention,
            x,
            angles,
            self.rotary if rotary is None else rotary,
            key_cache,
            value_cache,
            metadata,
            backend,
            attention,
            self.linear,
            self.ops,
        )


def grouped_experts_block(model: MoeForCausalLM, routing: GroupedTopK, take, maybe, cat) -> SparseMoeBlock:
    """A layer's experts as DeepSeek's checkpoints name them (and GLM-4.5's: engine/models/glm4_moe.py; Nemotron 3's,
    whose experts and shared expert are ungated relu^2 MLPs: engine/models/nemotron_h.py): the router `gate.weight`
    (logits in float32) with its `gate.e_score_correction_bias`, `routing` over them, and the `shared_experts`,
    added ungated; Nemotron 3's latent projections where its experts are narrower (`fc1_latent_proj`,
    `fc2_latent_proj`)."""
    moe, p = model.moe, model.moe.prefix
    activation = relu_squared if moe.ungated else None
    shared = None
    if moe.shared_intermediate_size is not None:
        s = p + "shared_experts."
        up = _float(take(s + "up_proj.weight"))
        shared = SharedExpert(
            gate_up=model._prepare(up if moe.ungated else _cat_rows(_float(take(s + "gate_proj.weight")), up)),
            # (int8 over several ranks: quantized whole before its columns were cut, models/tensor_parallel.py)
            down=model._prepare(take(s + "down_proj.weight")),
            gate=None,
            activation=activation,
        )
    bias = maybe(p + "gate.e_score_correction_bias")
    routing = dataclasses.replace(routing, correction_bias=None if bias is None else bias.float())
    latent = None
    if moe.latent_size is not None:  # (Nemotron 3's: the routed experts between two projections, replicated)
        latent = (
            model._prepare(take(p + "fc1_latent_proj.weight")),
            model._prepare(take(p + "fc2_latent_proj.weight")),
        )
    return SparseMoeBlock(
        _float(take(p + "gate.weight")),
        model._take_experts(take, maybe, cat),
        moe.top_k,
        moe.renormalize,
        model.linear,
        shared,
        activation=activation,
        gated=not moe.ungated,
        select=routing,
        router_in_float32=True,
        first_expert=moe.local_experts.start,
        latent=latent,
    )
