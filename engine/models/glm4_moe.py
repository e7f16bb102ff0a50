"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (Glm4MoeForCausalLM): Llama's attention (q/k/v biases, per-head q/k norms where
use_qk_norm) with RoPE over the first partial_rotary_factor of each head, in halves (unlike GLM-4's interleaved
pairs), dense MLPs in the first first_k_dense_replace layers, then DeepSeek-V3's mixture of experts: sigmoid
routing with e_score_correction_bias over groups of experts (engine/layers/grouped_routing.py) and ungated shared
experts (engine/models/deepseek.py's `grouped_experts_block`).

Checkpoints as `save_pretrained` writes them (`mlp.experts.N.{gate,up,down}_proj` or stacked, `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.shared_experts.*`). The router and its correction bias load in float32
whatever the model's dtype, as transformers keeps them. Layers past num_hidden_layers (the multi-token-prediction
layer, num_nextn_predict_layers, which engine/spec_decode/mtp.py reads) are not read.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.layers.moe import SparseMoeBlock
from engine.layers.rotary import RotaryEmbedding
from engine.models.deepseek import grouped_experts_block
from engine.models.glm4_moe_arch import Glm4MoeArch
from engine.models.llama_arch import LlamaArch
from engine.models.moe import MoeForCausalLM
from engine.quantization.weight_quantizer import WeightQuantizer

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\..*")


class Glm4MoeForCausalLM(MoeForCausalLM):
    """`MoeForCausalLM` with partial rotary and DeepSeek-V3's routed and shared experts in its sparse layers."""

    float32_names = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

    def __init__(
        self,
        arch: LlamaArch,
        glm: Glm4MoeArch,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        max_model_len: Optional[int] = None,
        tp: ParallelGroup = ParallelGroup.single(),
    ):
        """With several ranks `arch` and `glm.moe` are this rank's share (registry.build_model)."""
        self.rotary_dim = glm.rotary_dim  # (read by `_rotary`, which the base's constructor calls)
        super().__init__(arch, glm.moe, dtype, device, ops, linear, quantizer, tp, max_model_len)
        self.routing = glm.routing

    def _rotary(self, theta: float, scaling: Optional[dict], rotary_dim: Optional[int] = None) -> RotaryEmbedding:
        return super()._rotary(theta, scaling, self.rotary_dim)

    def load_weights(self, weights: Iterable) -> None:
        super().load_weights((name, tensor) for name, tensor in weights if self._causal_layer(name))

    def _causal_layer(self, name: str) -> bool:
        """False for the layers past num_hidden_layers: the multi-token-prediction layer, not the causal LM's."""
        match = _LAYER.fullmatch(name)
        return match is None or int(match.group(1)) < self.arch.num_layers

    def _take_block(self, take, maybe, cat) -> SparseMoeBlock:
        return grouped_experts_block(self, self.routing, take, maybe, cat)
