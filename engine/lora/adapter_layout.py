"""Where an adapter's matrices land in the served model: the family's module names mapped onto the projections the
model runs (q|k|v, o, gate|up or a plain MLP's up, down), with B's rows in the order the model holds the base rows.

A PEFT adapter names the modules of the family's HF model: Llama's q_proj ... down_proj; Phi-3's fused qkv_proj
and gate_up_proj; StarCoder2's c_fc / c_proj, Phi-2's dense / fc1 / fc2, GPT-NeoX's query_key_value, dense,
dense_h_to_4h, dense_4h_to_h. B multiplies the base product's output rows, so whatever the loader does to a base
matrix's rows (renames, GPT-NeoX's per-head q/k/v regrouped, q and k reordered for interleaved RoPE: `rows`, the
family's own transform of its checkpoint tensors) is done to B as if it were that matrix; A is untouched. A fused
module's B is then cut into its parts' rows, each part reading the module's one A:

    qkv_proj   A [r, hidden], B [q + 2 kv, r]  ->  q_proj (A, B[:q]), k_proj (A, B[q:q+kv]), v_proj (A, B[q+kv:])

which is exactly the fused delta, (x A^T)(B^T) side by side. A mixture of experts' experts are read apart
(`experts`, expert_layout.py); the dense MLPs beside them and its shared experts are not adapted: such a target is
refused by name, as is any module the model does not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch

from engine.lora.expert_layout import ExpertLayout

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The served projections, by Llama's names (what every adapter's modules become)."""

ATTENTION = PROJECTIONS[:4]

LANGUAGE_MODEL_PATH = frozenset({"base_model", "model", "language_model"})
"""What a served module's name may hold before `layers.`: PEFT's wrapper and the path to the language model's layers
(`model.`; a vision-language model's `model.language_model.` or `language_model.model.`). A vision tower's layers
are named as the language model's are (`vision_tower.encoder.layers.0.self_attn.q_proj`), and PEFT's
`target_modules: [q_proj]` adapts both: read as the language model's, its matrices would change the language
model's layers of the same index."""

MLP_KINDS = ("gated", "plain", "none")
"""gate|up and down; a plain MLP's up and down (no gate); none adapted (a mixture of experts: its experts apart)."""

Rows = Callable[[Iterable[tuple[str, torch.Tensor]]], Iterator[tuple[str, torch.Tensor]]]
"""A family's transform of its checkpoint's (name, tensor) pairs into Llama's names and the model's row order."""

_MODULE = re.compile(r"(?:(.*)\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight")


class UnservedModule(ValueError):
    """An adapter's module that the served model does not adapt (peft_adapter turns it into a LoRAAdapterError)."""


@dataclass(frozen=True)
class AdapterLayout:
    """How a family's adapter modules map onto the served projections (the whole model's sizes: a rank's part is
    cut from the whole adapter afterwards, engine/lora_shard.py)."""

    family: str = "llama"  # the HF model type, for messages
    q_size: int = 0  # heads * head_dim, kv_size likewise, intermediate_size: where fused modules' B rows split
    kv_size: int = 0
    intermediate_size: int = 0
    mlp: str = "gated"  # in MLP_KINDS
    plain_names: tuple[str, str] = ("up_proj", "down_proj")  # a plain MLP's two products, by the checkpoint's names
    rows: Optional[Rows] = None  # None: the checkpoint's names and rows are the model's (the Llama family)
    aliases: tuple[tuple[str, str], ...] = ()  # (Llama's name, the family's) where `rows` renames (Phi-2's dense)
    hidden_size: int = 0  # with the sizes above, each piece's shape is checked against the model's (0: not checked)
    experts: Optional[ExpertLayout] = None  # a mixture of experts whose experts take adapters

    def __post_init__(self):
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"mlp {self.mlp!r} is not one of {MLP_KINDS}")

    @property
    def fused(self) -> dict[str, tuple[str, ...]]:
        """The model's projections and the served projections fused into each, in their order along its output."""
        projections: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",)}
        if self.mlp != "none":
            projections["gate_up"] = ("gate_proj", "up_proj") if self.mlp == "gated" else ("up_proj",)
            projections["down"] = ("down_proj",)
        return projections

    def targets(self) -> list[str]:
        """The modules an adapter may target, by the family's names (as a refusal lists them)."""
        names = list(ATTENTION) + (["qkv_proj"] if self.q_size else [])
        if self.mlp == "gated":
            names += ["gate_proj", "up_proj", "down_proj"] + (["gate_up_proj"] if self.intermediate_size else [])
        elif self.mlp == "plain":
            names += list(self.plain_names)
        if self.experts is not None:
            names += ["experts.gate_up_proj", "experts.down_proj", "experts.{e}." + "|".join(self.experts.names)]
        aliases = dict(self.aliases)
        return [aliases.get(name, name) for name in names]

    def split(self, module: str, a: torch.Tensor, b: torch.Tensor) -> list[tuple[int, str, torch.Tensor, torch.Tensor]]:
        """One adapted module (its name in the base model, as PEFT's rank_pattern reads it: model.layers.3.mlp.c_fc),
        its A [r, in] and B [out, r] -> (layer, projection, A, B) per served projection it covers, B's rows in the
        model's order. UnservedModule when the model does not adapt it."""
        try:
            named = (
                (module + ".weight", b) if self.rows is None else next(iter(self.rows([(module + ".weight", b)])), None)
            )
        except (ValueError, RuntimeError) as exc:  # B's rows do not fit the family's regrouping (another size's)
            raise UnservedModule(f"{module!r}: its lora_B of {b.shape[0]} rows does not fit the model: {exc}") from None
        if named is None:  # (a name the family's loader drops: GPT-NeoX's mask buffers)
            raise UnservedModule(f"{module!r} is not a layer's projection (targets served: {self.targets()})")
        name, b = named
        match = _MODULE.fullmatch(name)
        if match is None:
            raise UnservedModule(f"{module!r} is not a layer's projection (targets served: {self.targets()})")
        path, layer, parent, projection = match.group(1) or "", int(match.group(2)), match.group(3), match.group(4)
        if not set(path.split(".")) <= LANGUAGE_MODEL_PATH | {""}:
            raise UnservedModule(
                f"{module!r} adapts {path!r}, not the language model's layers: LoRA is served on those alone"
            )
        pieces = self._pieces(parent, projection, b)
        if pieces is None:
            raise UnservedModule(f"target {module!r} is not served on {self.family} (only {self.targets()})")
        for served, rows in pieces:
            self._check_shape(module, served, a, rows)
        return [(layer, served, a, rows) for served, rows in pieces]

    def _check_shape(self, module: str, projection: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """An adapter trained on another size of the family is refused as it loads, not when a slot first takes it."""
        if not self.hidden_size:
            return
        hidden, q, kv, inter = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        widths = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
        widths.update(gate_proj=(hidden, inter), up_proj=(hidden, inter), down_proj=(inter, hidden))
        inputs, outputs = widths[projection]
        if a.shape[1] != inputs or b.shape[0] != outputs:
            raise UnservedModule(
                f"{module!r} ({projection}) is {b.shape[0]} x {a.shape[1]} (lora_B rows x lora_A columns); the "
                f"model's is {outputs} x {inputs}: an adapter of another model"
            )

    def _pieces(self, parent: str, projection: str, b: torch.Tensor) -> Optional[list[tuple[str, torch.Tensor]]]:
        if parent == "self_attn":
            if projection in ATTENTION:
                return [(projection, b)]
            if projection == "qkv_proj" and self.q_size:
                return self._cut(("q_proj", "k_proj", "v_proj"), (self.q_size, self.kv_size, self.kv_size), b)
            return None
        if self.mlp == "plain":
            up, down = self.plain_names
            served = {up: "up_proj", down: "down_proj"}.get(projection)
            return None if served is None else [(served, b)]
        if self.mlp == "gated":
            if projection in PROJECTIONS[4:]:
                return [(projection, b)]
            if projection == "gate_up_proj" and self.intermediate_size:
                return self._cut(("gate_proj", "up_proj"), (self.intermediate_size,) * 2, b)
        return None

    @staticmethod
    def _cut(names: tuple[str, ...], widths: tuple[int, ...], b: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if b.shape[0] != sum(widths):
            raise UnservedModule(f"a fused B of {b.shape[0]} rows; the model's {'|'.join(names)} has {sum(widths)}")
        return [(name, part.contiguous()) for name, part in zip(names, torch.split(b, list(widths)))]
