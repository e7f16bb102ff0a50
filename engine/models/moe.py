"""Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama-family decoder (attention, norms, RoPE, q/k norms, qkv
biases as there) whose MLP is, in its sparse layers, a mixture of experts (engine/layers/moe.py). The same blocks
serve the generic decoder's mixtures of experts (models/decoder_moe.py: OLMoE, Granite MoE, Phi-3.5-MoE,
Llama 4).

Checkpoints name each expert's matrices apart (`block_sparse_moe.experts.N.w1|w3|w2` for Mixtral and
Phi-3.5-MoE, `mlp.experts.N.gate_proj|up_proj|down_proj` for Qwen MoE and OLMoE: what transformers'
`save_pretrained` writes); they are stacked at load into [E, 2I, H] (gate|up) and [E, H, I] (down). Checkpoints
that already store them stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I], transformers'
in-memory layout; Granite MoE's `input_linear` and `output_linear`) are taken as they are; Llama 4's, stored
transposed (`experts.gate_up_proj` [E, H, 2I], `experts.down_proj` [E, I, H]), are transposed at load.

Quantized experts stay one matrix per expert (gate|up fused in their own storage): a GGUF's blocks as read
(engine/loading/gguf_experts.py cuts llama.cpp's stacks per expert), or each expert quantized by
--quantization int8/int4 like the dense projections. The router and Qwen2-MoE's shared-expert gate stay in
full precision (a GGUF's are F32 already): they are a few rows, and a rounding there changes which experts a
token reaches, not only by how much.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.layers.moe import ExpertWeights, SharedExpert, SparseMoeBlock
from engine.layers.moe_routing import select_top_sigmoid, sparse_mixer
from engine.models.llama import LlamaForCausalLM, LlamaLayerWeights
from engine.models.llama_arch import LlamaArch
from engine.models.moe_arch import MoeArch
from engine.profiling.memory_bandwidth import tensor_bytes
from engine.quantization.int4_groups import Int4Groups
from engine.quantization.quantized_weight import QuantizedWeight
from engine.quantization.weight_quantizer import WeightQuantizer


class MoeForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` with a `SparseMoeBlock` in place of the dense MLP of each sparse layer."""

    quantized_experts = True  # whether --quantization int8/int4 serves this family (its subclasses say)
    # (with the generic decoder, models/decoder_moe.py, the MRO puts DecoderForCausalLM where LlamaForCausalLM is:
    # `super()` here reaches the generic decoder's layer, MLP and loading)

    def __init__(
        self,
        arch: LlamaArch,
        moe: MoeArch,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        tp: ParallelGroup = ParallelGroup.single(),
        max_model_len: Optional[int] = None,
    ):
        """`max_model_len`: the longest sequence served (None: the config's context), as LlamaForCausalLM's."""
        if quantizer is not None and not self.quantized_experts:
            raise ValueError(
                f"--quantization {quantizer.method} is not supported for {arch.model_type}: its experts are "
                f"kept in {str(dtype).removeprefix('torch.')} (supported for Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, "
                "OLMoE, Granite MoE, Phi-3.5-MoE and Llama 4)"
            )
        # with several ranks `arch` and `moe` are this rank's share (its heads, each expert's share of the width):
        # the block's partial output is all-reduced with the layer's, as a dense MLP's
        super().__init__(arch, dtype, device, ops, linear, quantizer, max_model_len, tp)
        self.moe = moe
        self.fused = None  # the fused decode step (layers/fused_decode.py) runs dense MLPs only
        # by the layer loop's index: a pipeline stage's own (its first layer 0), the model's when it runs whole
        self.moe_blocks: dict[int, SparseMoeBlock] = {}

    def _take_mlp(self, index: int, take, maybe, cat) -> dict:
        if not self.moe.is_sparse(index):  # (`index`: the model's, which the sparse layers' pattern counts)
            return super()._take_mlp(index, take, maybe, cat)
        self.moe_blocks[index - self.stage.layers.start] = self._take_block(take, maybe, cat)
        return dict(gate_up=None, gate_up_bias=None, down=None, down_bias=None)

    def _take_block(self, take, maybe, cat) -> SparseMoeBlock:
        moe = self.moe
        p = moe.prefix
        experts = self._take_experts(take, maybe, cat)
        shared = None
        if moe.shared_intermediate_size is not None:
            names = moe.shared_names
            assert names is not None  # MoeArch names the shared expert wherever it has one
            shared = SharedExpert(
                gate_up=self._prepare(cat(*(take(name) for name in names.gate_up))),
                down=self._prepare(take(names.down)),
                gate=None if names.gate is None else self.linear.prepare(self._full_precision(take(names.gate))),
            )
        eps = moe.sparse_mixer_eps
        select = None if eps is None else partial(sparse_mixer, jitter_eps=eps)
        if moe.sigmoid_scores_on_input:
            select = partial(select_top_sigmoid, top_k=moe.top_k)
        return SparseMoeBlock(
            self._full_precision(take(p + moe.router_name)),
            experts,
            moe.top_k,
            moe.renormalize,
            self.linear,
            shared,
            moe.weights_in_model_dtype,
            softmax_after_top_k=moe.softmax_after_top_k,
            select=select,
            scores_on_input=moe.sigmoid_scores_on_input,
            first_expert=moe.local_experts.start,
        )

    def _take_experts(self, take, maybe, cat) -> ExpertWeights:
        moe = self.moe
        p = moe.prefix
        gate_up_name, down_stacked = moe.stacked_names
        # (a family stored stacked only: its tensors required)
        stacked_gate_up = maybe(p + gate_up_name) if moe.expert_names is not None else take(p + gate_up_name)
        stacked: Optional[ExpertWeights] = None
        stacked_down = None if stacked_gate_up is None else take(p + down_stacked)
        if moe.stacked_transposed and stacked_gate_up is not None:  # Llama 4's [E, H, 2I] and [E, I, H]
            stacked_gate_up = _float(stacked_gate_up).transpose(1, 2).contiguous()
            if not isinstance(stacked_down, list):  # (a rank's int8 downs: transposed before they were cut)
                stacked_down = _float(stacked_down).transpose(1, 2).contiguous()
        if isinstance(stacked_down, list):  # a tensor-parallel rank's int8 downs, each cut from its whole expert's
            gate_up, down = list(_float(stacked_gate_up)), stacked_down
        elif stacked_gate_up is not None:  # already stacked: [E, 2I, H] and [E, H, I], kept so where they stay float
            stacked = ExpertWeights(_float(stacked_gate_up), _float(stacked_down))
            gate_up, down = list(stacked.gate_up), list(stacked.down)
        else:
            assert moe.expert_names is not None  # (else taken stacked above)
            gate, up, down_name = moe.expert_names
            gate_up, down = [], []
            for e in moe.local_experts:
                q = f"{p}experts.{e}."
                ups = take(q + up + ".weight")
                gate_up.append(ups if moe.ungated else cat(take(q + gate + ".weight"), ups))
                down.append(take(q + down_name + ".weight"))
        experts = stacked if stacked is not None and self.quantizer is None else self._expert_weights(gate_up, down)
        intermediate, hidden = moe.expert_intermediate_size, moe.latent_size or self.arch.hidden_size
        expected = (((1 if moe.ungated else 2) * intermediate, hidden), (hidden, intermediate))
        shapes = {(_shape(g), _shape(d)) for g, d in zip(gate_up, down)}
        if len(gate_up) != len(moe.local_experts) or shapes != {expected}:
            raise ValueError(
                f"{len(gate_up)} experts of shapes {sorted(shapes)}, expected {len(moe.local_experts)} of "
                f"{expected[0]} and {expected[1]} from the config"
            )
        return experts

    def _expert_weights(self, gate_up: list, down: list) -> ExpertWeights:
        """Float experts stacked ([E, 2I, H], [E, H, I]: what the grouped CUDA kernel reads); quantized ones (stored
        so, or by --quantization) one matrix per expert."""
        if self.quantizer is not None:
            gate_up, down = [self.quantizer(g) for g in gate_up], [self.quantizer(d) for d in down]
            if not all(isinstance(w, torch.Tensor) for w in gate_up + down):
                return ExpertWeights(gate_up, down)
            # (a GPTQ checkpoint's experts dequantized at load: floats, stacked as a float checkpoint's)
        if all(isinstance(w, torch.Tensor) for w in gate_up + down):
            return ExpertWeights(torch.stack(gate_up), torch.stack(down))
        if any(isinstance(w, Int4Groups) for w in gate_up + down):
            raise ValueError("the checkpoint holds int4 (AWQ) experts but the model was built without a quantizer")
        return ExpertWeights(gate_up, down)

    def _full_precision(self, weight) -> torch.Tensor:
        """A router or gate in the model's dtype (dequantized where a GGUF stores it in blocks)."""
        if isinstance(weight, QuantizedWeight):
            return weight.dequantize(self.dtype)
        return _float(weight)

    def _mlp(self, index: int, layer: LlamaLayerWeights, x: torch.Tensor) -> torch.Tensor:
        block = self.moe_blocks.get(index)
        if block is None:
            return super()._mlp(index, layer, x)
        step = self.lora_step  # (an adapter's expert deltas: engine/lora/expert_deltas.py)
        experts = None if step is None or step.experts is None else step.experts.at(index)
        return block.forward(x, self.linear, self.ops, experts)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The dense matrices, then every expert's (a step whose tokens reach every expert reads them all)."""
        experts = [m for block in self.moe_blocks.values() for m in block.matrices()]
        if self.lm_head is None:  # a pipeline stage without the head
            return super().weight_tensors() + experts
        return super().weight_tensors()[:-1] + experts + [self.lm_head]

    def weight_bytes(self) -> int:
        return super().weight_bytes() + tensor_bytes([t for b in self.moe_blocks.values() for t in b.tensors()])


def _cat_rows(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat(tensors, dim=0).contiguous()


def _float(tensor) -> torch.Tensor:
    """A checkpoint tensor taken as floats (GPT-OSS's and DeepSeek's experts and attention, stacked experts)."""
    if isinstance(tensor, (QuantizedWeight, Int4Groups)):
        raise ValueError(
            f"these mixture-of-experts weights stored quantized ({type(tensor).__name__}) are not "
            "supported; load the checkpoint without --quantization gguf (dequantized on load)"
        )
    return tensor


def _shape(weight) -> tuple[int, ...]:
    return tuple(weight.shape) if isinstance(weight, torch.Tensor) else (weight.out_features, weight.in_features)
