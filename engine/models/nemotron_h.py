"""Nemotron-H (models/nemotron_h_arch.py): blocks of one mixer each, `h + mixer(RMSNorm(h))`, the mixer a Mamba-2
layer (models/hybrid.py's), attention without positional embedding, a plain relu^2 MLP, or (Nemotron 3,
`NemotronHMoeForCausalLM`) a mixture of such MLPs with DeepSeek-V3's routing and a shared expert.

The generic decoder's parts serve each mixer (its attention call, its plain MLP, its norms, embeddings and LM head;
a mixture: models/moe.py's experts and layers/moe.py's block); the layer loop is this model's own, since a block
holds one mixer where the generic decoder's layer holds attention and an MLP. The KV cache holds the attention blocks
only, in their order.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.layer_attention import LayerAttention
from engine.distributed.parallel_group import ParallelGroup
from engine.distributed.pipeline_stage import PipelineStage
from engine.layers.linear import Linear
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.mrope import SectionedRows
from engine.layers.moe import SparseMoeBlock
from engine.models.decoder import DecoderForCausalLM, DecoderLayerWeights
from engine.models.decoder_moe import DecoderMoeForCausalLM
from engine.models.hybrid import HybridLayers
from engine.models.deepseek import grouped_experts_block
from engine.models.llama import layer_tensors
from engine.models.nemotron_h_arch import NemotronHArch
from engine.quantization.weight_quantizer import WeightQuantizer


class NemotronHForCausalLM(HybridLayers, DecoderForCausalLM):  # type: ignore[misc]  # (as models/hybrid.py's)
    mamba_layers_have_mlp = False
    mamba_prefix = "mixer."

    def __init__(
        self,
        nemotron: NemotronHArch,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        max_model_len: Optional[int] = None,
        tp: ParallelGroup = ParallelGroup.single(),
    ):
        """`nemotron`: this rank's share with several ranks (its heads, its MLPs' width, its Mamba-2 heads)."""
        super().__init__(nemotron.decoder, dtype, device, ops, linear, quantizer, max_model_len, tp)
        self._hold_blocks(nemotron)

    def _hold_blocks(self, nemotron: NemotronHArch) -> None:
        self.hybrid = nemotron.hybrid
        self._hold_recurrent_layers(nemotron.hybrid.recurrent_layers)
        self.blocks = nemotron.blocks
        self.fused = None  # (the fused decode step runs the generic decoder's layer)

    @property
    def attention_layers(self) -> tuple[LayerAttention, ...]:
        return tuple(a for a, kind in zip(self.layer_attention, self.blocks) if kind == "attention")

    def hold_stage(self, stage: PipelineStage) -> None:
        super().hold_stage(stage)
        self.blocks = self.blocks[stage.layers.start : stage.layers.stop]

    def _take_attention_layer(self, state: dict, index: int) -> DecoderLayerWeights:
        """An attention or MLP block (a Mamba-2 block: HybridLayers._take_layer) by its mixer's names."""
        take, maybe = layer_tensors(state, index)
        kind = self.blocks[index - self.stage.layers.start]
        if kind == "moe":
            model: Any = self  # (a NemotronHMoeForCausalLM: its blocks by the layer loop's index)
            model.moe_blocks[index - self.stage.layers.start] = model._take_block(take, maybe, self._cat_rows)
        prepare, attention = self._prepare, kind == "attention"
        mlp = kind == "mlp"
        qkv = self._cat_rows(*(take(f"mixer.{part}_proj.weight") for part in "qkv")) if attention else None
        return DecoderLayerWeights(
            norms={"attn_pre": take("norm.weight")},
            norm_biases={},
            qkv=prepare(qkv) if attention else None,
            qkv_bias=None,
            q_norm=None,
            k_norm=None,
            o_proj=prepare(take("mixer.o_proj.weight")) if attention else None,
            o_bias=None,
            gate_up=prepare(take("mixer.up_proj.weight")) if mlp else None,
            gate_up_bias=maybe("mixer.up_proj.bias") if mlp else None,
            down=prepare(take("mixer.down_proj.weight")) if mlp else None,
            down_bias=maybe("mixer.down_proj.bias") if mlp else None,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens] (read by no block: none has a positional embedding)
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: Sequence[AttentionMetadata],  # each attention block's
        backend: AttentionBackend,
        hidden_states: Optional[torch.Tensor] = None,
        sectioned: Optional[SectionedRows] = None,
    ) -> torch.Tensor:  # [num_tokens, hidden], before the final norm
        if sectioned is not None:
            raise ValueError("NemotronHForCausalLM does not rotate by multimodal RoPE")
        h = self.input_embeddings(input_ids) if hidden_states is None else hidden_states
        caches = iter(zip(kv_caches, metadata, strict=True))
        for index, (layer, kind) in enumerate(zip(self.layers, self.blocks)):
            x = self._norm(h, layer, "attn_pre")
            out: Any
            if kind == "mamba":
                out = self._recurrent_mix(index, x)
            elif kind == "attention":
                (key_cache, value_cache), step = next(caches)
                attention = self.layer_attention[index]
                out = self._layer_attention(
                    layer, x, None, None, key_cache, value_cache, step, backend, attention, index
                )
            else:
                out = self._mlp_branch(index, layer, x)
            h = h + out
        return h


# (mypy: as models/hybrid.py's HybridMoeForCausalLM, the bases type `_mlp`'s layer as their own layer weights)
class NemotronHMoeForCausalLM(NemotronHForCausalLM, DecoderMoeForCausalLM):  # type: ignore[misc]
    """Nemotron 3: Nemotron-H with mixture-of-experts blocks. Its experts load as models/moe.py loads every
    family's (per expert or stacked, quantized, each rank's share or held experts), ungated; its router and the
    correction bias in float32, as transformers keeps them."""

    float32_names = ("mixer.gate.weight", "mixer.gate.e_score_correction_bias")

    def __init__(
        self,
        nemotron: NemotronHArch,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        max_model_len: Optional[int] = None,
        tp: ParallelGroup = ParallelGroup.single(),
    ):
        """`nemotron.moe`: this rank's experts with several ranks (each one's share of the width, or those held)."""
        if nemotron.moe is None or nemotron.routing is None:
            raise ValueError("NemotronHMoeForCausalLM: the config has no mixture-of-experts block")
        DecoderMoeForCausalLM.__init__(
            self, nemotron.decoder, nemotron.moe, dtype, device, ops, linear, quantizer, tp, max_model_len
        )
        self.routing = nemotron.routing
        self._hold_blocks(nemotron)

    def _take_block(self, take, maybe, cat) -> SparseMoeBlock:
        return grouped_experts_block(self, self.routing, take, maybe, cat)
