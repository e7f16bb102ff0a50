"""A sparse mixture-of-experts MLP: a router picks `top_k` of `E` SwiGLU experts per token.

    router logits = x @ router^T                           [T, E]
    routing       = select_experts(logits, top_k, ...)     (moe_routing.py)
    rows          = x's tokens grouped by expert           [T * top_k, H], one segment per expert
    expert e      = down_e(silu(gate_e(rows)) * up_e(rows)), one product per expert with rows
                    (GPT-OSS: biases on both products and its clamped SwiGLU, clamped_swiglu.py)
    out[t]       += weight(t, e) * expert e's row of t     (index_add over the sorted rows)
                    (Llama 4, `scores_on_input`: expert e of weight(t, e) * x[t], added unweighted)
    (+ sigmoid(x @ shared_gate^T) * shared MLP(x)          Qwen2-MoE's shared expert)
    (+ shared MLP(x)                                       DeepSeek's shared experts: no gate)
    (Nemotron-H: ungated experts, down_e(relu(up_e(rows))^2), its shared expert alike: `gated` False; with a
     `latent` width, the routed experts' rows are fc1(x) and their sum goes through fc2)

A family may bring its own routing of the logits (`select`: DeepSeek's grouped top-k, grouped_routing.py),
computed from float32 logits where HF keeps the router in float32 (`router_in_float32`).

Every expert's weights are stored once, gate|up fused: `ExpertWeights` holds [E, 2I, H] and [E, H, I]
(and, where the family has them, their biases [E, 2I] and [E, H]), or, where the experts are quantized (a GGUF's
blocks, --quantization int8/int4), E matrices [2I, H] and E matrices [H, I], each multiplied by its own product
(the native GGUF kernels, torch's int8/int4 ones) over the rows routed to it.
On CPU each expert's rows go through the model's own product (`Linear`: float32 column blocks on AVX2 and AVX-512
builds, elsewhere oneDNN's packed fp32, the native
bf16 kernels, the batch-invariant one), so the experts run on what the dense layers run on; where that
product reads plain weights the per-expert matrices are views of the stacked tensors, elsewhere the
stacked tensors are dropped once each expert is packed. On CUDA the whole block runs as two grouped
Triton products (engine/kernels/triton/fused_moe.py) over the stacked tensors (their biases and the activation
included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from engine.layers.clamped_swiglu import ClampedSwiGLU
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear, Weight
from engine.layers.row_invariant import rowwise_sigmoid
from engine.layers.moe_routing import Routing, group_by_expert, select_experts, select_top_logits

if TYPE_CHECKING:
    from engine.lora.expert_deltas import LayerExpertDeltas


@dataclass(slots=True)
class ExpertWeights:
    # [E, 2 * I, H]: each expert's gate rows, then its up rows; or E matrices [2 * I, H] (quantized experts)
    gate_up: Union[torch.Tensor, Sequence[Weight]]
    down: Union[torch.Tensor, Sequence[Weight]]  # [E, H, I]; or E matrices [H, I]
    gate_up_bias: Optional[torch.Tensor] = None  # [E, 2 * I] (GPT-OSS), in gate_up's row order
    down_bias: Optional[torch.Tensor] = None  # [E, H]

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    @property
    def intermediate_size(self) -> int:
        first = self.down[0]
        return first.shape[1] if isinstance(first, torch.Tensor) else first.in_features

    @property
    def is_stacked(self) -> bool:
        return isinstance(self.gate_up, torch.Tensor) and isinstance(self.down, torch.Tensor)


def relu_squared(h: torch.Tensor) -> torch.Tensor:
    """relu(h)^2 of an ungated expert's up product (HF's ReLUSquaredActivation, Nemotron-H's relu2)."""
    return torch.square(F.relu(h))


@dataclass(slots=True)
class SharedExpert:
    """The dense expert every token goes through: Qwen2-MoE's scaled by a sigmoid gate of its own, DeepSeek's
    (its n_shared_experts as one MLP) added as it is."""

    gate_up: torch.Tensor  # [2 * I_shared, H], in the form `linear` takes (ungated: up [I_shared, H])
    down: torch.Tensor  # [H, I_shared], idem
    gate: Optional[torch.Tensor]  # [1, H], idem; None: no gate
    activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # an ungated MLP's; None: SwiGLU


class SparseMoeBlock:
    """One layer's experts, router and optional shared expert; `forward` replaces the dense MLP."""

    def __init__(
        self,
        router: torch.Tensor,
        experts: ExpertWeights,
        top_k: int,
        renormalize: bool,
        linear: Linear,
        shared: Optional[SharedExpert] = None,
        weights_in_model_dtype: bool = False,
        *,
        router_bias: Optional[torch.Tensor] = None,
        softmax_after_top_k: bool = False,
        activation: Optional[Union[ClampedSwiGLU, Callable[[torch.Tensor], torch.Tensor]]] = None,
        gated: bool = True,
        select: Optional[Callable[[torch.Tensor], Routing]] = None,
        router_in_float32: bool = False,
        scores_on_input: bool = False,
        first_expert: int = 0,
        latent: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ):
        routed = router.shape[0]  # every expert the router scores; `experts` may hold some (expert parallelism)
        if not 0 < top_k <= routed:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {routed} experts")
        if not 0 <= first_expert <= routed - experts.num_experts:
            raise ValueError(f"experts {first_expert}.. ({experts.num_experts} of them) are not among {routed}")
        # expert parallelism (models/expert_parallel.py): this block holds experts [first, first + num_experts) and
        # computes only their (token, expert) pairs; the ranks' outputs add up in the layer's all-reduce
        self.first_expert = first_expert
        self.holds_every_expert = experts.num_experts == routed
        self.router_in_float32 = router_in_float32
        # [E, H]: float32 as stored where the logits are float32 (DeepSeek), else through the model's product
        # (batch invariant when it is)
        self.router = router.float() if router_in_float32 else linear.prepare(router)
        self.router_bias = router_bias  # [E] (GPT-OSS)
        self.softmax_after_top_k = softmax_after_top_k  # GPT-OSS: top-k of the logits, softmax over those
        self.select = select  # a family's own routing of the logits (DeepSeek's grouped routing)
        self.activation = activation  # None: SwiGLU (the layer ops' silu_and_mul)
        # False: each expert's "gate_up" is its up alone [I, H], `activation` taking all of its output (Nemotron-H)
        self.gated = gated
        # Llama 4: each routed row is the token's input times its weight, in the model's dtype, and the experts'
        # outputs are summed as they come (the grouped Triton kernel weighs outputs: the per-expert path serves it)
        self.scores_on_input = scores_on_input
        # Nemotron 3's moe_latent_size: the routed experts run in a narrower width L, between fc1 [L, H] and
        # fc2 [H, L] (in `linear`'s form; no bias: fc2 over a rank's partial sum is that rank's share)
        self.latent = latent
        self.biases = [
            (
                None if experts.gate_up_bias is None else experts.gate_up_bias[e],
                None if experts.down_bias is None else experts.down_bias[e],
            )
            for e in range(experts.num_experts)
        ]  # [(gate_up [2I], down [H]) or Nones] per expert
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_model_dtype = weights_in_model_dtype  # Qwen MoE rounds the top-k weights to it, Mixtral not
        self.shared = shared
        self.num_experts = experts.num_experts
        per_expert = [(linear.prepare(g), linear.prepare(d)) for g, d in zip(experts.gate_up, experts.down)]
        views = experts.is_stacked and all(
            _is_view(g, gate_up) and _is_view(d, down)
            for (g, d), gate_up, down in zip(per_expert, experts.gate_up, experts.down)
        )
        # the stacked tensors stay only when the per-expert forms are their views (no second copy)
        self.stacked: Optional[ExpertWeights] = experts if views else None
        self.per_expert = per_expert  # [(gate_up [2I, H], down [H, I]) in `linear`'s form] per expert

    def matrices(self) -> list:
        """Every matrix the block may read (all experts'), as its product takes them."""
        mats = [m for pair in self.per_expert for m in pair] + list(self.latent or ())
        return mats + ([self.shared.gate_up, self.shared.down] if self.shared is not None else [])

    def tensors(self) -> list:
        """Everything it stores, for its memory."""
        extra = [self.router] + ([self.shared.gate] if self.shared is not None and self.shared.gate is not None else [])
        biases = [b for pair in self.biases for b in pair if b is not None]
        return self.matrices() + extra + biases + ([self.router_bias] if self.router_bias is not None else [])

    def route(self, x: torch.Tensor, linear: Linear) -> Routing:
        if self.router_in_float32:
            bias = None if self.router_bias is None else self.router_bias.float()
            logits = F.linear(x.float(), self.router, bias)
        else:
            logits = linear(x, self.router, self.router_bias)
        if self.select is not None:
            return self.select(logits)
        if self.softmax_after_top_k:
            routing = select_top_logits(logits, self.top_k)
        else:
            routing = select_experts(logits, self.top_k, self.renormalize)
        if self.weights_in_model_dtype:
            return Routing(routing.weights.to(x.dtype), routing.expert_ids)
        return routing

    def forward(
        self, x: torch.Tensor, linear: Linear, ops: TorchLayerOps, lora: Optional["LayerExpertDeltas"] = None
    ) -> torch.Tensor:
        """x [T, H] (normed) -> [T, H]. `lora`: the step's adapters' expert deltas, added to each expert's gate|up
        and down products over its rows (the per-expert products then run: the grouped kernel's are not split).
        Holding some of the experts (expert parallelism), the sum of their pairs' outputs (plus the shared
        expert's share) for the layer's all-reduce."""
        routing = self.route(x, linear)
        inputs = x if self.latent is None else linear(x, self.latent[0], None)
        out = self._routed(inputs, routing, linear, ops, lora)
        if self.latent is not None:
            out = linear(out, self.latent[1], None)
        if self.shared is None:
            return out
        shared = self.shared
        up = linear(x, shared.gate_up, None)
        dense = linear(ops.silu_and_mul(up) if shared.activation is None else shared.activation(up), shared.down, None)
        if shared.gate is None:
            return out + dense
        return out + rowwise_sigmoid(linear(x, shared.gate, None)) * dense

    def _routed(
        self,
        x: torch.Tensor,
        routing: Routing,
        linear: Linear,
        ops: TorchLayerOps,
        lora: Optional["LayerExpertDeltas"],
    ) -> torch.Tensor:
        """The routed experts' weighted sum for each row of x (the grouped CUDA kernel, or a product per expert)."""
        fused_moe = None if lora is not None else self._fused_kernel(x.device)
        if fused_moe is not None:
            stacked = self.stacked
            assert stacked is not None  # _fused_kernel gives a kernel only where the stacked tensors are kept
            out = fused_moe(
                x,
                stacked.gate_up,
                stacked.down,
                routing.weights,
                routing.expert_ids,
                gate_up_bias=stacked.gate_up_bias,
                down_bias=stacked.down_bias,
                activation=self.activation,
                first_expert=None if self.holds_every_expert else self.first_expert,
            )
            return out
        return self._grouped(x, routing, linear, ops, lora)

    def _fused_kernel(self, device: torch.device):
        """The grouped Triton kernel on CUDA (when Triton is installed), else None: the per-expert products."""
        if device.type != "cuda" or self.stacked is None or self.scores_on_input or not self.gated:
            return None  # (the kernel computes gate|up experts)
        try:
            from engine.kernels.triton.fused_moe import fused_moe
        except ImportError:  # CUDA without Triton (flash-attn serves attention): the grouped torch path
            return None
        return fused_moe

    def _grouped(
        self,
        x: torch.Tensor,
        routing: Routing,
        linear: Linear,
        ops: TorchLayerOps,
        lora: Optional["LayerExpertDeltas"] = None,
    ) -> torch.Tensor:
        groups = group_by_expert(routing)
        if not self.holds_every_expert:
            groups = groups.held(self.first_expert, self.num_experts)
            if not groups.experts:  # no token chose this rank's experts
                return torch.zeros_like(x)
        rows = x.index_select(0, groups.token_index)  # [T * top_k, H] (this block's pairs), sorted by expert
        if self.scores_on_input:  # (HF: the product in the model's dtype, its weights rounded to it)
            rows = rows * groups.weights[:, None].to(x.dtype)
        outputs = []
        for expert, start, count in groups.segments():
            gate_up, down = self.per_expert[expert]
            gate_up_bias, down_bias = self.biases[expert]
            expert_rows = rows[start : start + count]
            h = linear(expert_rows, gate_up, gate_up_bias)
            if lora is not None:
                tokens = groups.token_index[start : start + count]
                lora.add(expert, "gate_up", expert_rows, tokens, h)
            h = ops.silu_and_mul(h) if self.activation is None else self.activation(h)
            out = linear(h, down, down_bias)
            if lora is not None:
                lora.add(expert, "down", h, tokens, out)
            outputs.append(out)
        out_rows = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        # as HF: each expert's output, rounded to the model's dtype, times its weight, rounded, then added
        if self.scores_on_input:
            weighted = out_rows.to(x.dtype)
        else:
            weighted = (out_rows * groups.weights[:, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, groups.token_index, weighted)


def _is_view(form, row: torch.Tensor) -> bool:
    """Whether a prepared expert matrix is the stacked tensor's own row (a plain tensor sharing its memory)."""
    return isinstance(form, torch.Tensor) and not form.is_mkldnn and form.data_ptr() == row.data_ptr()
