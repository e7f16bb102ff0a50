"""Hybrid decoders: the generic decoder's layers, some of whose token mixers are recurrent layers: Mamba-2 (Granite
4.0-H, Bamba here; Nemotron-H: models/nemotron_h.py), LFM2's short convolutions (models/lfm2.py), Qwen3.5's Gated
DeltaNet (models/qwen3_5.py).

The layer loop is the generic decoder's (models/decoder.py): where a layer is one of `recurrent_layers` it runs
`_recurrent_mix` instead of attention, and takes no KV cache (the runner's KV cache holds the attention layers
only, in their order: `attention_layers`). The recurrent layers read and write the requests' states through the
step the runner sets (`recurrent_step`, as it sets `lora_step`; layers/recurrent_state.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from engine.attention.layer_attention import LayerAttention
from engine.distributed.parallel_group import ParallelGroup
from engine.distributed.pipeline_stage import PipelineStage
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.layers.mamba2 import MambaWeights, mamba_mix
from engine.layers.recurrent_state import RecurrentStates, RecurrentStep, StateShape
from engine.models.llama import layer_tensors
from engine.models.decoder import DecoderForCausalLM, DecoderLayerWeights
from engine.models.decoder_arch import DecoderArch
from engine.models.decoder_moe import DecoderMoeForCausalLM
from engine.models.hybrid_arch import HybridArch
from engine.models.moe_arch import MoeArch
from engine.profiling.memory_bandwidth import tensor_bytes
from engine.quantization.weight_quantizer import WeightQuantizer


class HybridLayers:
    """What a hybrid decoder adds to the generic one (mixed in before it): its recurrent layers' weights, loading,
    states and forward (Mamba-2's here; other mixers override `_take_mixer`, `_recurrent_mix` and `state_shape`), and
    the attention layers alone as the KV cache's. With several ranks `hybrid` is this rank's share
    (hybrid_arch.shard_mamba): its heads, and its groups of B and C."""

    hybrid: HybridArch
    layer_attention: tuple[LayerAttention, ...]
    recurrent_step: Optional[RecurrentStep]
    mamba_layers_have_mlp = True  # (Granite 4.0-H's layers: a mixer and an MLP; Nemotron-H's blocks: one mixer)
    mamba_prefix = "mamba."  # the Mamba-2 layer's tensors' names within a layer (Nemotron-H's: "mixer.")

    def _hold_recurrent_layers(self, layers: tuple[int, ...]) -> None:
        self.recurrent_layers = frozenset(layers)
        self.mixers: dict[int, Any] = {}  # by layer: MambaWeights (a short convolution's: models/lfm2.py)
        self._state_layer = {layer: k for k, layer in enumerate(layers)}  # its states' index
        self.recurrent_step = None  # set by the runner around each step's forward pass

    @property
    def attention_layers(self) -> tuple[LayerAttention, ...]:
        """The attention layers' attention, in their order: the KV cache's layers."""
        return tuple(a for i, a in enumerate(self.layer_attention) if i not in self.recurrent_layers)

    @property
    def state_shape(self) -> StateShape:
        """What each recurrent layer keeps per request."""
        return self.hybrid.mamba.state

    def recurrent_states(self, rows: int, snapshots: int = 0) -> Optional[RecurrentStates]:
        """Zeroed states of `rows` requests and `snapshots` snapshots for every recurrent layer (None: the model has
        none)."""
        if not self.recurrent_layers:
            return None
        model: Any = self
        shape, num_layers = self.state_shape, len(self.recurrent_layers)
        return RecurrentStates(shape, num_layers, rows, model.dtype, model.device, snapshots)

    def recurrent_state_bytes(self, rows: int) -> int:
        model: Any = self
        return rows * self.state_shape.bytes_per_row(len(self.recurrent_layers), model.dtype)

    def hold_stage(self, stage: PipelineStage) -> None:
        """The decoder's stage, and its recurrent layers by the stage's own index (the layer loop's)."""
        model: Any = super()
        model.hold_stage(stage)
        layers = stage.layers
        self._hold_recurrent_layers(
            tuple(layer - layers.start for layer in sorted(self.recurrent_layers) if layer in layers)
        )

    def _take_layer(self, state: dict, index: int) -> DecoderLayerWeights:
        """Layer `index` (the model's; the stage's own: `local`)."""
        model: Any = self
        local = index - model.stage.layers.start
        if local not in self.recurrent_layers:
            return self._take_attention_layer(state, index)
        take, maybe = layer_tensors(state, index)

        self.mixers[local] = self._take_mixer(take, maybe)
        norms = model.arch.norms
        no_mlp = dict(gate_up=None, gate_up_bias=None, down=None, down_bias=None)
        return DecoderLayerWeights(
            norms={role: take(name + ".weight") for role, name in norms},
            norm_biases={},
            qkv=None,
            qkv_bias=None,
            q_norm=None,
            k_norm=None,
            o_proj=None,
            o_bias=None,
            **(model._take_mlp(index, take, maybe, model._cat_rows) if self.mamba_layers_have_mlp else no_mlp),
        )

    def _take_mixer(self, take: Callable[[str], torch.Tensor], maybe: Callable[[str], Optional[torch.Tensor]]) -> Any:
        """A recurrent layer's mixer weights (a Mamba-2 layer's), by their names within the layer."""
        model: Any = self
        m = self.mamba_prefix
        prepare = model._prepare
        return MambaWeights(
            in_proj=prepare(take(m + "in_proj.weight")),
            in_proj_bias=maybe(m + "in_proj.bias"),
            conv_weight=take(m + "conv1d.weight")[:, 0, :].contiguous(),
            conv_bias=maybe(m + "conv1d.bias"),
            dt_bias=take(m + "dt_bias").float(),
            A=-torch.exp(take(m + "A_log").float()),
            D=take(m + "D").float(),
            norm=take(m + "norm.weight"),
            out_proj=prepare(take(m + "out_proj.weight")),
            out_proj_bias=maybe(m + "out_proj.bias"),
        )

    def _recurrent_mix(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `index`'s Mamba-2 output, all-reduced over the ranks (each rank's heads' partial sums)."""
        model: Any = self
        tp = model.tp
        out = mamba_mix(
            x,
            self.mixers[index],
            self.hybrid.mamba,
            model.linear,
            self.recurrent_step,
            self._state_layer[index],
            tp.all_reduce,
        )
        return tp.all_reduce(out)

    def _take_attention_layer(self, state: dict, index: int) -> DecoderLayerWeights:
        """An attention layer: the decoder's (the next class in the model's MRO)."""
        model: Any = super()
        return model._take_layer(state, index)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The decoder's matrices and the recurrent layers' in_proj and out_proj."""
        model: Any = super()
        return model.weight_tensors() + [w for m in self.mixers.values() for w in (m.in_proj, m.out_proj)]

    def weight_bytes(self) -> int:
        model: Any = super()
        mixers = [getattr(m, name) for m in self.mixers.values() for name in type(m).__slots__]
        return model.weight_bytes() + tensor_bytes(mixers)


# (mypy: the generic decoder's `_take_layer` is typed with its own layer weights, and DecoderMoeForCausalLM's bases
# type `_mlp`'s layer each their own)
class HybridForCausalLM(HybridLayers, DecoderForCausalLM):  # type: ignore[misc]
    """A hybrid decoder whose every MLP is dense (Granite 4.0-H without experts: its shared MLP)."""

    def __init__(
        self,
        arch: DecoderArch,
        hybrid: HybridArch,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        max_model_len: Optional[int] = None,
        tp: ParallelGroup = ParallelGroup.single(),
    ):
        super().__init__(arch, dtype, device, ops, linear, quantizer, max_model_len, tp)
        self.hybrid = hybrid
        self._hold_recurrent_layers(hybrid.recurrent_layers)
        self.fused = None  # (the fused decode step runs attention layers only)


class HybridMoeForCausalLM(HybridLayers, DecoderMoeForCausalLM):  # type: ignore[misc]
    """A hybrid decoder whose MLPs are mixtures of experts (Granite 4.0-H Tiny and Small)."""

    def __init__(
        self,
        arch: DecoderArch,
        moe: MoeArch,
        hybrid: HybridArch,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        max_model_len: Optional[int] = None,
        tp: ParallelGroup = ParallelGroup.single(),
    ):
        super().__init__(arch, moe, dtype, device, ops, linear, quantizer, tp, max_model_len)
        self.hybrid = hybrid
        self._hold_recurrent_layers(hybrid.recurrent_layers)
