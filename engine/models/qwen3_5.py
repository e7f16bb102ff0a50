"""Qwen3.5's text model (families.py's qwen3_5_arch): the generic decoder's layer, whose token mixer is, on the layers
`layer_types` names `linear_attention`, a Gated DeltaNet (layers/gated_delta_net.py) keeping a conv window and a
[v_heads, d_k, d_v] state per request (layers/recurrent_state.py), instead of attention; models/hybrid.py's
recurrent layers otherwise. Its attention layers gate each head's output (DecoderArch.attention_gate)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.layers.gated_delta_net import DeltaNetShape, DeltaNetWeights, delta_net_mix
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.layers.recurrent_state import StateShape
from engine.models.decoder import DecoderForCausalLM
from engine.models.decoder_arch import DecoderArch
from engine.models.decoder_moe import DecoderMoeForCausalLM
from engine.models.hybrid import HybridLayers
from engine.models.moe_arch import MoeArch
from engine.quantization.weight_quantizer import WeightQuantizer


def read_delta_net(config: Any) -> DeltaNetShape:
    """The linear-attention layers' shape from a Qwen3.5 text config; ValueError for what is not served."""
    if config.hidden_act != "silu":
        raise ValueError(f"Qwen3.5: hidden_act {config.hidden_act!r} is not served (silu)")
    shape = DeltaNetShape(
        num_k_heads=int(config.linear_num_key_heads),
        num_v_heads=int(config.linear_num_value_heads),
        head_k_dim=int(config.linear_key_head_dim),
        head_v_dim=int(config.linear_value_head_dim),
        conv_kernel=int(config.linear_conv_kernel_dim),
        norm_eps=float(config.rms_norm_eps),
    )
    if shape.num_v_heads % shape.num_k_heads:
        raise ValueError(
            f"Qwen3.5: linear_num_value_heads {shape.num_v_heads} are not whole groups of linear_num_key_heads "
            f"{shape.num_k_heads}"
        )
    return shape


def ungrouped_projections(
    qkvz: torch.Tensor, ba: torch.Tensor, shape: DeltaNetShape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-Next's fused projections, whose rows come per key head ([q_h; k_h; its value heads' v; their z] and
    [their b; their a]), as Qwen3.5's: q | k | v, z, b, a, each in head order (transformers'
    fix_query_key_value_ordering, applied to the weights' rows). A tensor-parallel rank's rows are whole key heads'
    groups, so its shard reorders alike."""
    per_key = shape.num_v_heads // shape.num_k_heads
    dk, dv = shape.head_k_dim, shape.head_v_dim
    groups = qkvz.unflatten(0, (shape.num_k_heads, -1))  # [k_heads, 2 dk + 2 per_key dv, hidden]
    q, k, v, z = groups.split([dk, dk, per_key * dv, per_key * dv], dim=1)
    b, a = ba.unflatten(0, (shape.num_k_heads, -1)).split([per_key, per_key], dim=1)
    qkv = torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)])
    return qkv, z.flatten(0, 1), b.flatten(0, 1), a.flatten(0, 1)


class DeltaNetLayers(HybridLayers):
    """A Qwen3.5 model's linear-attention layers (mixed in before its decoder): their weights, state and forward."""

    delta_net: DeltaNetShape

    @property
    def state_shape(self) -> StateShape:
        return self.delta_net.state

    def _held(self, name: str) -> bool:
        """Not the multi-token-prediction layer's tensors (mtp.*, which the checkpoints hold beside the model, as
        transformers skips them): speculative decoding is not served with recurrent states."""
        model: Any = super()
        return not name.startswith("mtp.") and model._held(name)

    def _take_mixer(self, take: Callable[[str], torch.Tensor], maybe: Callable[[str], Optional[torch.Tensor]]) -> Any:
        p = "linear_attn."
        qkvz = maybe(p + "in_proj_qkvz.weight")
        projections: tuple[torch.Tensor, ...]
        if qkvz is not None:  # Qwen3-Next's projections, grouped by key head
            projections = ungrouped_projections(qkvz, take(p + "in_proj_ba.weight"), self.delta_net)
        else:
            projections = tuple(take(f"{p}in_proj_{part}.weight") for part in ("qkv", "z", "b", "a"))
        model: Any = self
        return DeltaNetWeights(
            in_proj=model._prepare(torch.cat(projections).contiguous()),
            conv_weight=take(p + "conv1d.weight")[:, 0, :].contiguous(),
            dt_bias=take(p + "dt_bias").float(),
            A=-torch.exp(take(p + "A_log").float()),
            norm=take(p + "norm.weight"),
            out_proj=model._prepare(take(p + "out_proj.weight")),
        )

    def _recurrent_mix(self, index: int, x: torch.Tensor) -> torch.Tensor:
        model: Any = self
        step, layer = self.recurrent_step, self._state_layer[index]
        return model.tp.all_reduce(delta_net_mix(x, self.mixers[index], self.delta_net, model.linear, step, layer))


class Qwen3_5ForCausalLM(DeltaNetLayers, DecoderForCausalLM):  # type: ignore[misc]  # (as models/hybrid.py's)
    def __init__(
        self,
        arch: DecoderArch,
        linear_layers: tuple[int, ...],
        delta_net: DeltaNetShape,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        max_model_len: Optional[int] = None,
        tp: ParallelGroup = ParallelGroup.single(),
    ):
        super().__init__(arch, dtype, device, ops, linear, quantizer, max_model_len, tp)
        self._hold_recurrent_layers(linear_layers)
        self.delta_net = delta_net
        self.fused = None  # (the fused decode step runs attention layers only)


class Qwen3_5MoeForCausalLM(DeltaNetLayers, DecoderMoeForCausalLM):  # type: ignore[misc]  # (as models/hybrid.py's)
    """Qwen3.5-MoE's text model: Qwen3.5's layers whose MLPs are mixtures of experts (Qwen2-MoE's, with a gated
    shared expert)."""

    def __init__(
        self,
        arch: DecoderArch,
        moe: MoeArch,
        linear_layers: tuple[int, ...],
        delta_net: DeltaNetShape,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        max_model_len: Optional[int] = None,
        tp: ParallelGroup = ParallelGroup.single(),
    ):
        super().__init__(arch, moe, dtype, device, ops, linear, quantizer, tp, max_model_len)
        self._hold_recurrent_layers(linear_layers)
        self.delta_net = delta_net
        self.fused = None
