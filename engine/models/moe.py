"""Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama-family decoder (attention, norms, RoPE, q/k norms, qkv
biases as there) whose MLP is, in its sparse layers, a mixture of experts (engine/layers/moe.py).

Checkpoints name each expert's matrices apart (`block_sparse_moe.experts.N.w1|w3|w2` for Mixtral,
`mlp.experts.N.gate_proj|up_proj|down_proj` for Qwen MoE: what transformers' `save_pretrained` writes);
they are stacked at load into [E, 2I, H] (gate|up) and [E, H, I] (down). Checkpoints that already store
them stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I], transformers' in-memory
layout) are taken as they are.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.layers.moe import ExpertWeights, SharedExpert, SparseMoeBlock
from engine.models.llama import LlamaForCausalLM, LlamaLayerWeights
from engine.models.llama_arch import LlamaArch
from engine.models.moe_arch import MoeArch
from engine.profiling.memory_bandwidth import tensor_bytes
from engine.quantization.int4_groups import Int4Groups
from engine.quantization.quantized_weight import QuantizedWeight
from engine.quantization.weight_quantizer import WeightQuantizer


class MoeForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` with a `SparseMoeBlock` in place of the dense MLP of each sparse layer."""

    def __init__(
        self,
        arch: LlamaArch,
        moe: MoeArch,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
    ):
        if quantizer is not None:
            raise ValueError(
                f"--quantization {quantizer.method} is not supported for mixture-of-experts models "
                f"({arch.model_type}): their experts are kept in {str(dtype).removeprefix('torch.')}"
            )
        super().__init__(arch, dtype, device, ops, linear, quantizer)
        self.moe = moe
        self.fused = None  # the fused decode step (layers/fused_decode.py) runs dense MLPs only
        self.moe_blocks: dict[int, SparseMoeBlock] = {}

    def load_weights(self, weights) -> None:
        if self.quantization == "gguf":  # set by the builder before loading
            raise ValueError(
                f"--quantization gguf is not supported for mixture-of-experts models "
                f"({self.arch.model_type}): llama.cpp's stacked expert tensors have no quantized "
                f"product here yet; use --quantization none (the GGUF is dequantized on load)"
            )
        super().load_weights(weights)

    def _take_mlp(self, index: int, take, maybe, cat) -> dict:
        if not self.moe.is_sparse(index):
            return super()._take_mlp(index, take, maybe, cat)
        self.moe_blocks[index] = self._take_block(take, maybe)
        return dict(gate_up=None, gate_up_bias=None, down=None, down_bias=None)

    def _take_block(self, take, maybe) -> SparseMoeBlock:
        moe = self.moe
        p = moe.prefix
        experts = self._take_experts(take, maybe)
        shared = None
        if moe.shared_intermediate_size is not None:
            s = p + "shared_expert."
            shared = SharedExpert(
                gate_up=self._prepare(_cat_rows(take(s + "gate_proj.weight"), take(s + "up_proj.weight"))),
                down=self._prepare(take(s + "down_proj.weight")),
                gate=self.linear.prepare(_float(take(p + "shared_expert_gate.weight"))),
            )
        return SparseMoeBlock(
            _float(take(p + "gate.weight")),
            experts,
            moe.top_k,
            moe.renormalize,
            self.linear,
            shared,
            moe.weights_in_model_dtype,
        )

    def _take_experts(self, take, maybe) -> ExpertWeights:
        moe = self.moe
        p = moe.prefix + "experts."
        stacked_gate_up = maybe(p + "gate_up_proj")
        if stacked_gate_up is not None:  # already stacked: [E, 2I, H] and [E, H, I]
            experts = ExpertWeights(_float(stacked_gate_up), _float(take(p + "down_proj")))
        else:
            gate, up, down = moe.expert_names
            gate_up, downs = [], []
            for e in range(moe.num_experts):
                q = f"{p}{e}."
                gate_up.append(_cat_rows(_float(take(q + gate + ".weight")), _float(take(q + up + ".weight"))))
                downs.append(_float(take(q + down + ".weight")))
            experts = ExpertWeights(torch.stack(gate_up), torch.stack(downs))
        intermediate, hidden = moe.expert_intermediate_size, self.arch.hidden_size
        expected = ((moe.num_experts, 2 * intermediate, hidden), (moe.num_experts, hidden, intermediate))
        if (tuple(experts.gate_up.shape), tuple(experts.down.shape)) != expected:
            raise ValueError(
                f"experts of shapes {tuple(experts.gate_up.shape)} and {tuple(experts.down.shape)}, "
                f"expected {expected[0]} and {expected[1]} from the config"
            )
        return experts

    def _mlp(self, index: int, layer: LlamaLayerWeights, x: torch.Tensor) -> torch.Tensor:
        block = self.moe_blocks.get(index)
        if block is None:
            return super()._mlp(index, layer, x)
        return block.forward(x, self.linear, self.ops)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The dense matrices, then every expert's (a step whose tokens reach every expert reads them all)."""
        experts = [m for block in self.moe_blocks.values() for m in block.matrices()]
        return super().weight_tensors()[:-1] + experts + [self.lm_head]

    def weight_bytes(self) -> int:
        return super().weight_bytes() + tensor_bytes([t for b in self.moe_blocks.values() for t in b.tensors()])


def _cat_rows(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat(tensors, dim=0).contiguous()


def _float(tensor) -> torch.Tensor:
    """A checkpoint tensor the experts take: float (they have no quantized product yet)."""
    if isinstance(tensor, (QuantizedWeight, Int4Groups)):
        raise ValueError(
            f"mixture-of-experts weights stored quantized ({type(tensor).__name__}) are not "
            "supported; load the checkpoint without --quantization gguf (dequantized on load)"
        )
    return tensor
