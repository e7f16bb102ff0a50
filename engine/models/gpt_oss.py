"""GPT-OSS: the Llama layer with q/k/v/o biases and YaRN, each layer's attention sliding or full (`layer_types`)
with attention sinks, and a mixture of experts with biases and a clamped SwiGLU.

    attention   softmax over [q . k for the keys seen] + [sinks[h]], the sink's share dropped (no value)
    router      logits = x @ W^T + b; the top-k logits, softmax over those k
    expert e    (x @ gate_up_e + b) -> ClampedSwiGLU -> (@ down_e + b)

The checkpoint stores the experts stacked as transformers keeps them: `experts.gate_up_proj` [E, H, 2I] with
gate and up interleaved (gate in the even columns), `experts.down_proj` [E, I, H], their biases, and
`self_attn.sinks` [heads]. At load the experts become the house's [E, 2I, H] (gate rows, then up rows) and
[E, H, I]; the sinks join each layer's LayerAttention. OpenAI's released checkpoints store the two expert matrices
as MXFP4 (`gate_up_proj_blocks`/`_scales`, ...; quantization/mxfp4.py): dequantized to the model's dtype as they
are read, into transformers' layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.layers.clamped_swiglu import ClampedSwiGLU
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.layers.moe import ExpertWeights, SparseMoeBlock
from engine.models.gpt_oss_arch import GptOssArch
from engine.models.llama import LlamaLayerWeights
from engine.models.moe import MoeForCausalLM, _float
from engine.quantization.mxfp4 import SUFFIXES as MXFP4_SUFFIXES
from engine.quantization.mxfp4 import mxfp4_weights
from engine.quantization.weight_quantizer import WeightQuantizer

MXFP4_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""The tensors an MXFP4 checkpoint stores quantized (its biases, attention, router and embeddings stay float)."""


class GptOssForCausalLM(MoeForCausalLM):
    """`MoeForCausalLM` with GPT-OSS's experts and router, and each layer's own attention (window, sinks)."""

    quantized_experts = False  # its experts (interleaved gate|up, biases) load as floats only

    def __init__(
        self,
        arch: GptOssArch,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        max_model_len: Optional[int] = None,
        tp: ParallelGroup = ParallelGroup.single(),
    ):
        """With several ranks `arch` is this rank's share (gpt_oss_arch.shard_gpt_oss_arch) and the weights its
        slices (tensor_parallel.shard_weights: MXFP4 blocks are cut before they are dequantized)."""
        super().__init__(arch.llama, arch.moe, dtype, device, ops, linear, quantizer, tp, max_model_len)
        self.mxfp4 = arch.mxfp4
        self.layer_attention = arch.layer_attention  # the sinks join them at load
        # layer -> [heads], float32; by the layer loop's index (a pipeline stage's own, as `layer_attention`'s)
        self.sinks: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        if self.mxfp4:
            # (a pipeline stage leaves the other stages' expert blocks packed: never dequantized)
            held = ((name, tensor) for name, tensor in weights if self._held(name.removeprefix("model.")))
            weights = mxfp4_weights(held, MXFP4_TENSORS, self.dtype, self.device)
        else:
            weights = self._refuse_mxfp4(weights)
        super().load_weights(weights)
        self.layer_attention = tuple(
            dataclasses.replace(attention, sinks=self.sinks[index])
            for index, attention in enumerate(self.layer_attention)
        )

    @staticmethod
    def _refuse_mxfp4(weights: Iterable[tuple[str, torch.Tensor]]):
        for name, tensor in weights:
            if name.endswith(MXFP4_SUFFIXES):
                raise ValueError(
                    f"GptOssForCausalLM: {name} is an MXFP4 tensor but config.json's quantization_config does not "
                    "name quant_method 'mxfp4'"
                )
            yield name, tensor

    def _take_layer(self, state: dict, index: int) -> LlamaLayerWeights:
        name = f"layers.{index}.self_attn.sinks"
        sinks = state.pop(name, None)
        if sinks is None:
            raise ValueError(f"checkpoint lacks {name}")
        self.sinks[index - self.stage.layers.start] = sinks.to(torch.float32).contiguous()
        return super()._take_layer(state, index)

    def _take_block(self, take, maybe, cat) -> SparseMoeBlock:
        moe, hidden = self.moe, self.arch.hidden_size
        p = moe.prefix
        gate_up = _float(take(p + "experts.gate_up_proj"))  # [E, H, 2I], gate and up interleaved
        gate_up_bias = _float(take(p + "experts.gate_up_proj_bias"))  # [E, 2I], interleaved alike
        down = _float(take(p + "experts.down_proj"))  # [E, I, H]
        expected = (len(moe.local_experts), hidden, 2 * moe.expert_intermediate_size)
        if tuple(gate_up.shape) != expected or tuple(down.shape) != (expected[0], expected[2] // 2, hidden):
            raise ValueError(
                f"experts of shapes {tuple(gate_up.shape)} and {tuple(down.shape)}, expected "
                f"{expected} and {(expected[0], expected[2] // 2, hidden)} from the config"
            )
        rows = gate_up.transpose(1, 2)  # [E, 2I, H]
        experts = ExpertWeights(
            gate_up=_halves(rows, dim=1),  # [E, 2I, H]: gate rows, then up rows
            down=down.transpose(1, 2).contiguous(),  # [E, H, I]
            gate_up_bias=_halves(gate_up_bias, dim=1),
            down_bias=_float(take(p + "experts.down_proj_bias")).contiguous(),  # [E, H]
        )
        assert moe.swiglu_limit is not None  # gpt_oss_arch sets it
        return SparseMoeBlock(
            _float(take(p + "router.weight")),
            experts,
            moe.top_k,
            moe.renormalize,
            self.linear,
            weights_in_model_dtype=moe.weights_in_model_dtype,
            router_bias=_float(take(p + "router.bias")),
            softmax_after_top_k=moe.softmax_after_top_k,
            activation=ClampedSwiGLU(moe.swiglu_alpha, moe.swiglu_limit),
            first_expert=moe.local_experts.start,
        )

    def weight_bytes(self) -> int:
        return super().weight_bytes() + sum(s.numel() * s.element_size() for s in self.sinks.values())


def _halves(interleaved: torch.Tensor, dim: int) -> torch.Tensor:
    """[..., 2I, ...] with gate at the even and up at the odd indices of `dim` -> [gate | up] along `dim`."""
    index = torch.arange(interleaved.shape[dim], device=interleaved.device)
    order = torch.cat([index[0::2], index[1::2]])
    return interleaved.index_select(dim, order).contiguous()
