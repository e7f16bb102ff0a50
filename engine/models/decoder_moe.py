"""OLMoE, Granite MoE (and its shared-expert variant), Phi-3.5-MoE and Llama 4: the generic decoder's layer
(DecoderArch: where its norms sit and of which kind, q/k norms, multipliers, biases, windows, RoPE) whose MLP is,
in its sparse layers, MoeForCausalLM's mixture of experts (MoeArch: the routing, the experts' names).

    OLMoE          Llama's pre-norms, q and k RMSNorm over the whole projection; softmax top-k routing
                   (norm_topk_prob)
    Granite MoE    Granite's embedding, residual and attention multipliers and logits_scaling; experts stacked as
                   block_sparse_moe.input_linear / output_linear; the top-k logits' softmax; the shared variant's
                   shared_mlp added to every token
    Phi-3.5-MoE    LayerNorms with biases, q/k/v/o and LM-head biases, LongRoPE with its own mscales, a sliding
                   window; sparsemixer routing (layers/moe_routing.py)
    Llama 4        feed_forward renamed mlp; experts on moe_layers, dense MLPs (intermediate_size_mlp) between;
                   the top-k logits' sigmoids scale the experts' inputs; an ungated shared expert; NoPE layers with
                   attention temperature tuning, RoPE layers (interleaved pairs, llama3 scaling) with q/k L2 norms

Which family is which is the data its config gives (models/families.py, models/moe_arch.py); the layer loop
(DecoderForCausalLM.forward) names none.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.models.decoder import DecoderForCausalLM
from engine.models.decoder_arch import DecoderArch
from engine.models.moe import MoeForCausalLM
from engine.models.moe_arch import MoeArch
from engine.quantization.weight_quantizer import WeightQuantizer


# (mypy: the two bases type `_mlp`'s layer as their own layer weights; MoeForCausalLM's passes it on as it came)
class DecoderMoeForCausalLM(MoeForCausalLM, DecoderForCausalLM):  # type: ignore[misc]
    """MoeForCausalLM's blocks (loading, per-expert products, quantized experts) over DecoderForCausalLM's recipe:
    by the MRO, MoeForCausalLM's `super()` is the generic decoder (its layer, its dense MLP, its forward pass)."""

    arch: DecoderArch

    def __init__(
        self,
        arch: DecoderArch,
        moe: MoeArch,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        tp: ParallelGroup = ParallelGroup.single(),
        max_model_len: Optional[int] = None,
    ):
        """`arch` and `moe`: this rank's share with several ranks (engine/models/tensor_parallel.py)."""
        super().__init__(arch, moe, dtype, device, ops, linear, quantizer, tp, max_model_len)
