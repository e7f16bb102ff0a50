"""Every adapter slot's weights, stacked per layer and projection, padded to the largest rank.

A slot holds one adapter while requests using it run (LoRASlots assigns them). For each layer and each of
the model's (fused) projections:

    a[proj]  [max_loras, parts * max_rank, in]    lora_A of each part, one rank block per part
    b[proj]  [max_loras, parts * max_rank, out]   lora_B^T (scale folded in), block-diagonal over the parts

`parts` is how many projections the model fuses into it (the family's AdapterLayout.fused): qkv = q|k|v (3),
gate_up = gate|up (2; a plain MLP's up alone: 1), o and down (1); a mixture of experts has no MLP stacks (its
experts' are `experts`, expert_stack.py). For
qkv of one slot, with r = max_rank:

    a rows   [0, r) q's A    [r, 2r) k's A    [2r, 3r) v's A
    b rows   [0, r) -> q's output columns only, [r, 2r) -> k's, [2r, 3r) -> v's (zeros elsewhere)

so (x a^T) b is the three deltas side by side, the fused output's layout. An adapter's smaller rank, or a
projection it does not target, is zeros. Kept beside the base weights, never merged into them; slots in
[lo, hi) read as one [(hi - lo) * parts * r, ...] matrix (a view), which is how a step multiplies them all
at once (engine/lora/lora_step.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol

import torch

from engine.lora.adapter_layout import AdapterLayout
from engine.lora.expert_stack import ExpertLoRAStack
from engine.lora.peft_adapter import LoRAWeights

if TYPE_CHECKING:  # (engine.models imports the model, which reads a LoRAStack)
    from engine.kernels.cpu import CpuKernels


class PackedProduct(Protocol):
    """A product that packs its weights (engine.layers' Linear on CPU; engine.layers imports this room for the
    fused decode step, so it is named by what the stack calls, not imported)."""

    def prepare(self, weight: torch.Tensor) -> Any: ...
    def __call__(self, x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor]) -> torch.Tensor: ...


class ModelShape(Protocol):
    """What the stacks need of the model's shape (engine.models' LlamaArch has it; engine.models imports this
    room, not the other way round)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def model_type(self) -> str: ...


class AdapterCut(Protocol):
    """A rank's part of every adapter under tensor or pipeline parallelism (engine/lora_shard.py's AdapterShard;
    defined there, beside the model's own cut, which this room does not import)."""

    @property
    def layers(self) -> range:
        """The whole model's layers this rank holds (its pipeline stage's)."""
        ...

    @property
    def num_layers(self) -> int:
        """The whole model's layers."""
        ...

    @property
    def whole(self) -> ModelShape:
        """The whole model's shape (what an adapter file is written against)."""
        ...

    def cut(self, weights: LoRAWeights) -> LoRAWeights:
        """This rank's part of a whole adapter, its layers renumbered from this rank's first."""
        ...


class LoRAKernels(NamedTuple):
    """The segmented (SGMV) products of engine/kernels/triton/lora_sgmv.py: per token its slots, no slot range."""

    shrink: Callable[..., None]
    expand: Callable[..., None]
    group_by_slot: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def load(cls) -> Optional["LoRAKernels"]:
        """The Triton kernels, or None where they cannot be imported (no triton): the torch products run."""
        try:
            from engine.kernels.triton.lora_sgmv import group_by_slot, lora_expand, lora_shrink
        except ImportError:
            return None
        return cls(lora_shrink, lora_expand, group_by_slot)


def projection_shapes(arch: ModelShape, layout: AdapterLayout) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each fused projection's input width and its parts' output widths (`arch`: this rank's shape)."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    shapes = {
        "qkv": (hidden, (q, kv, kv)),
        "o_proj": (q, (hidden,)),
        "gate_up": (hidden, (inter, inter)),
        "down": (inter, (hidden,)),
    }
    fused = layout.fused  # (a plain MLP's gate_up: its up alone)
    return {proj: (width, outs[-len(fused[proj]) :]) for proj, (width, outs) in shapes.items() if proj in fused}


class LoRAStack:
    """The stacked slot weights of every layer (see the module docstring), and each slot's replacement
    embedding and LM head (modules_to_save)."""

    def __init__(
        self,
        arch: ModelShape,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        linear: Optional[PackedProduct] = None,
        kernels: Optional[LoRAKernels] = None,
        shard: Optional[AdapterCut] = None,
        native: Optional["CpuKernels"] = None,
        layout: AdapterLayout = AdapterLayout(),
        experts: Optional[ExpertLoRAStack] = None,
    ):
        """`linear`: a product that packs its weights (the model's, on CPU): every slot's A and B^T are then also
        kept packed for it, re-packed when a slot loads, and a step multiplies all slots through it (packed
        products of these small matrices run about twice as fast as torch.mm's on the raw ones).
        `kernels`: the Triton SGMV products (CUDA), which read each token's slots from the raw stacks.
        `shard`: a tensor-parallel rank's or pipeline stage's part of every adapter (`arch` is then the rank's
        shape), cut from the whole adapter as it loads (engine/lora_shard.py).
        `native`: the CPU kernels, whose deltas (csrc/lora_delta.h) read each token's slots from the raw stacks,
        up to each slot's rank (`ranks`); the fused decode step adds the same deltas.
        `layout`: which projections the family adapts and how its adapters' modules map onto them (a plain MLP's
        gate|up is its up alone; a mixture of experts has no MLP slots).
        `experts`: the slots' expert deltas of a mixture of experts whose experts take adapters."""
        self.arch = arch
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.layout = layout
        self.shapes = projection_shapes(arch, layout)
        self.shard = shard
        num_layers = arch.num_layers if shard is None else len(shard.layers)
        # One tensor per projection over every layer ([layers, max_loras, rows, width]), each layer's a view: a
        # slot loads with a few products over all layers at once instead of a few per layer and projection.
        self.a_all: dict[str, torch.Tensor] = {}
        self.b_all: dict[str, torch.Tensor] = {}
        for proj, (width, outs) in self.shapes.items():
            rows = len(outs) * max_rank
            self.a_all[proj] = torch.zeros(num_layers, max_loras, rows, width, dtype=dtype, device=device)
            self.b_all[proj] = torch.zeros(num_layers, max_loras, rows, sum(outs), dtype=dtype, device=device)
        self.a: list[dict[str, torch.Tensor]] = [
            {proj: t[layer] for proj, t in self.a_all.items()} for layer in range(num_layers)
        ]
        self.b: list[dict[str, torch.Tensor]] = [
            {proj: t[layer] for proj, t in self.b_all.items()} for layer in range(num_layers)
        ]
        # The same tensors as [max_loras * parts * max_rank, width] (views): a step's slot range is one row slice.
        self.a_rows = [{proj: t.view(-1, t.shape[-1]) for proj, t in layer.items()} for layer in self.a]
        self.b_rows = [{proj: t.view(-1, t.shape[-1]) for proj, t in layer.items()} for layer in self.b]
        self.rows_per_slot = {proj: len(outs) * max_rank for proj, (_, outs) in self.shapes.items()}
        self.linear = linear
        self.kernels = kernels
        self.native = native
        self.ranks = torch.zeros(max_loras, dtype=torch.int32)  # each slot's adapter's rank (0: empty)
        # packed A [max_loras * P, in] and B^T [out, max_loras * P] per layer and projection (with `linear`)
        self.a_packed: list[dict[str, Any]] = []
        self.bt_packed: list[dict[str, Any]] = []
        if linear is not None:
            self.a_packed = [{p: linear.prepare(t) for p, t in layer.items()} for layer in self.a_rows]
            self.bt_packed = [
                {p: linear.prepare(t.t().contiguous()) for p, t in layer.items()} for layer in self.b_rows
            ]
        self.experts = experts
        self.embed: list[Optional[torch.Tensor]] = [None] * max_loras  # [vocab, hidden] per slot
        self.lm_head: list[Optional[torch.Tensor]] = [None] * max_loras

    def parts(self, proj: str) -> int:
        return len(self.shapes[proj][1])

    def load(self, slot: int, weights: LoRAWeights) -> None:
        """Copy an adapter (the whole one, as read) into `slot` (whatever it held before is overwritten)."""
        if self.shard is not None:
            weights = self.shard.cut(weights)
        r = self.max_rank
        num_layers = len(self.a)
        for proj, parts in self.layout.fused.items():
            a_all, b_all = self.a_all[proj][:, slot], self.b_all[proj][:, slot]  # [L, parts * r, in], [L, ., out]
            a_all.zero_()
            b_all.zero_()
            column = 0
            for part, (name, width) in enumerate(zip(parts, self.shapes[proj][1])):
                pairs = [(weights.a.get((layer, name)), weights.b.get((layer, name))) for layer in range(num_layers)]
                for layer, (lora_a, lora_b) in enumerate(pairs):
                    if (
                        lora_a is not None
                        and lora_b is not None
                        and (lora_a.shape[1] != a_all.shape[2] or lora_b.shape[0] != width)
                    ):
                        raise ValueError(
                            f"adapter {weights.name!r}: layer {layer} {name} is {tuple(lora_b.shape[:1])} x "
                            f"{tuple(lora_a.shape[1:])}, the model's is ({width},) x ({a_all.shape[2]},)"
                        )
                whole = [(a, b) for a, b in pairs if a is not None and b is not None]
                if len(whole) == num_layers and len({a.shape[0] for a, _ in whole}) == 1:  # one rank: at once
                    rank = whole[0][0].shape[0]
                    a_all[:, part * r : part * r + rank].copy_(torch.stack([a for a, _ in whole]))
                    b_rows = b_all[:, part * r : part * r + rank, column : column + width]
                    b_rows.copy_(torch.stack([b for _, b in whole]).transpose(1, 2))
                else:
                    for layer, (lora_a, lora_b) in enumerate(pairs):
                        if lora_a is not None and lora_b is not None:
                            rank = lora_a.shape[0]
                            a_all[layer, part * r : part * r + rank].copy_(lora_a)
                            b_all[layer, part * r : part * r + rank, column : column + width].copy_(lora_b.t())
                column += width
            if self.linear is not None:
                for layer in range(num_layers):
                    self.a_packed[layer][proj] = self.linear.prepare(self.a_rows[layer][proj])
                    self.bt_packed[layer][proj] = self.linear.prepare(self.b_rows[layer][proj].t().contiguous())
        if self.experts is not None:
            self.experts.load(slot, weights)
        self.ranks[slot] = min(weights.rank, r)
        vocab, hidden = self.arch.vocab_size, self.arch.hidden_size
        for field in ("embed", "lm_head"):
            matrix = getattr(weights, field)
            if matrix is not None and tuple(matrix.shape) != (vocab, hidden):
                raise ValueError(
                    f"adapter {weights.name!r}: {field} is {tuple(matrix.shape)}, the model's is ({vocab}, {hidden})"
                )
            getattr(self, field)[slot] = None if matrix is None else matrix.to(device=self.device, dtype=self.dtype)

    @property
    def packed(self) -> bool:
        return self.linear is not None

    def nbytes(self) -> int:
        """The raw stacked matrices' bytes (packed copies, when kept, take as much again)."""
        dense = sum(t.numel() * t.element_size() for layer in (*self.a, *self.b) for t in layer.values())
        return dense + (0 if self.experts is None else self.experts.nbytes())
