"""LFM2 (models/families.py's lfm2_arch): the generic decoder's layer, whose token mixer is, on the layers
`layer_types` names `conv`, a gated short convolution (layers/short_conv.py) keeping a window of its last inputs
per request (layers/recurrent_state.py), instead of attention; models/hybrid.py's recurrent layers otherwise."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.layers.recurrent_state import StateShape
from engine.layers.short_conv import ShortConvWeights, short_conv_mix
from engine.models.decoder import DecoderForCausalLM
from engine.models.decoder_arch import DecoderArch
from engine.models.hybrid import HybridLayers
from engine.quantization.weight_quantizer import WeightQuantizer


class Lfm2ForCausalLM(HybridLayers, DecoderForCausalLM):  # type: ignore[misc]  # (as models/hybrid.py's)
    def __init__(
        self,
        arch: DecoderArch,
        conv_layers: tuple[int, ...],
        conv_kernel: int,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        max_model_len: Optional[int] = None,
        tp: ParallelGroup = ParallelGroup.single(),
    ):
        """`arch`: this rank's share with several ranks (its heads; its channels of each convolution: hidden_size
        / ranks)."""
        super().__init__(arch, dtype, device, ops, linear, quantizer, max_model_len, tp)
        self._hold_recurrent_layers(conv_layers)
        self.conv_width = arch.hidden_size // tp.world_size
        self.conv_kernel = conv_kernel
        self.fused = None  # (the fused decode step runs attention layers only)

    @property
    def state_shape(self) -> StateShape:
        return StateShape(self.conv_width, self.conv_kernel)

    def _take_mixer(self, take: Callable[[str], torch.Tensor], maybe: Callable[[str], Optional[torch.Tensor]]) -> Any:
        prepare = self._prepare
        return ShortConvWeights(
            in_proj=prepare(take("conv.in_proj.weight")),
            conv_weight=take("conv.conv.weight")[:, 0, :].contiguous(),
            conv_bias=maybe("conv.conv.bias"),
            out_proj=prepare(take("conv.out_proj.weight")),
            in_proj_bias=maybe("conv.in_proj.bias"),
            out_proj_bias=maybe("conv.out_proj.bias"),
        )

    def _recurrent_mix(self, index: int, x: torch.Tensor) -> torch.Tensor:
        out = short_conv_mix(x, self.mixers[index], self.linear, self.recurrent_step, self._state_layer[index])
        return self.tp.all_reduce(out)
