"""Reading a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into per-layer matrices.

What is served: LoRA (`peft_type` "LORA") on the attention and MLP projections of a layer, by the family's own
module names (adapter_layout.py maps them onto the model's projections), any rank,
`lora_alpha / r` scaling or rsLoRA's `lora_alpha / sqrt(r)` (per-module `rank_pattern` / `alpha_pattern`
honoured), a mixture of experts' experts (PEFT's `target_parameters` on the stacked experts, or per-expert
modules: expert_layout.py), and `modules_to_save` holding `embed_tokens` and `lm_head` (whole replacement matrices). Anything
else (DoRA, bias training, other targets or adapter kinds) is refused by name: serving it as plain LoRA would
give other outputs than the adapter was trained to give.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generator, Optional

import torch

from engine.errors import LoRAAdapterError, LoRARankError
from engine.lora.adapter_layout import LANGUAGE_MODEL_PATH, AdapterLayout, UnservedModule
from engine.lora.expert_layout import ExpertModule, ExpertPieces, UnservedExperts, expert_module

_LORA_KEY = re.compile(r"(.+)\.lora_([AB])(?:\.\w+)?\.weight$")

SAVED_MODULES = ("embed_tokens", "lm_head")
"""The modules_to_save served: whole matrices that replace the base's for the adapter's requests."""

BASE_CHANGING_INITS = ("olora", "corda", "lora_ga")
"""PEFT initialisations that change the base weights (as PiSSA's do): saved unconverted, such an adapter's deltas
are relative to that changed base."""

EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
"""The parameters PEFT's `target_parameters` may name: a mixture of experts' stacked experts (expert_layout.py)."""

_PEFT_WRAPPER = "base_model.model."
"""What PEFT's saved keys hold before the base model's own module names."""


@dataclass(slots=True)
class LoRAWeights:
    """One adapter's matrices, scale folded into B: delta(x) = (x A^T) B^T for each (layer, projection).

    `a[(layer, proj)]`: [rank, in]; `b[(layer, proj)]`: [out, rank], already multiplied by the module's
    scale. `embed` [vocab, hidden] and `lm_head` [vocab, hidden]: modules_to_save, or None.
    """

    name: str
    path: str
    rank: int  # the largest module rank
    a: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    b: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    embed: Optional[torch.Tensor] = None
    lm_head: Optional[torch.Tensor] = None
    content_hash: bytes = b""  # of the adapter file: part of the prefix-cache key (a reloaded changed file differs)

    @property
    def nbytes(self) -> int:
        tensors = [*self.a.values(), *self.b.values(), self.embed, self.lm_head]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def read_adapter_config(name: str, path: Path, max_rank: int) -> dict:
    """The adapter's config, refused when it is not something the engine serves exactly."""
    return parse_adapter_config(name, _read_config(name, path), max_rank)


def _read_config(name: str, path: Path) -> bytes:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAAdapterError(name, f"no adapter_config.json in {str(path)!r}")
    return config_file.read_bytes()


def parse_adapter_config(name: str, text: bytes, max_rank: int) -> dict:
    """`adapter_config.json`'s content, checked (see `read_adapter_config`)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LoRAAdapterError(name, f"adapter_config.json is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(name, f"adapter_config.json holds {type(config).__name__}, not a JSON object")
    _check_field_types(name, config)
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRAAdapterError(name, f"peft_type {kind!r} is not served (LoRA only)")
    if config.get("use_dora"):
        raise LoRAAdapterError(name, "DoRA (use_dora) is not served: its magnitude vectors change the base product")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise LoRAAdapterError(name, f"trained biases (bias {config.get('bias')!r}, lora_bias) are not served")
    if config.get("fan_in_fan_out"):
        raise LoRAAdapterError(name, "fan_in_fan_out (Conv1D-style weights) is not served")
    # (alora_invocation_tokens: activated LoRA adapts only the tokens from the invocation on; use_qalora: A reads
    # inputs pooled by groups. Either served as plain LoRA would change every token's output otherwise.)
    refused = ("layers_to_transform", "layer_replication", "trainable_token_indices")
    for key in (*refused, "alora_invocation_tokens", "use_qalora"):
        if config.get(key):
            raise LoRAAdapterError(name, f"{key} is not served")
    parameters = config.get("target_parameters") or []
    unserved = [p for p in parameters if not isinstance(p, str) or not p.endswith(EXPERT_PARAMETERS)]
    if unserved:
        raise LoRAAdapterError(
            name, f"target_parameters {unserved} are not served (only a mixture of experts' {list(EXPERT_PARAMETERS)})"
        )
    init = config.get("init_lora_weights")
    if isinstance(init, str) and (init.startswith("pissa") or init in BASE_CHANGING_INITS):
        raise LoRAAdapterError(
            name,
            f"init_lora_weights {init!r}: its initialisation subtracted B A from the base weights, so it adapts a base "
            "other than this one (PEFT converts it to plain LoRA when saved with path_initial_model_for_weight_conversion)",
        )
    saved = [m for m in config.get("modules_to_save") or [] if not _saved_module(m)]
    if saved:
        raise LoRAAdapterError(name, f"modules_to_save {saved} are not served (only {list(SAVED_MODULES)})")
    rank = int(config.get("r", 8))
    ranks = [rank, *(int(r) for r in (config.get("rank_pattern") or {}).values())]
    if max(ranks) > max_rank:
        raise LoRARankError(name, max(ranks), max_rank)
    return config


def _saved_module(module: str) -> bool:
    """Whether a modules_to_save entry names the embedding or the LM head: bare, or by its path in the model (PEFT
    matches entries as suffixes of the full name, and its ensure_weight_tying writes the tied module's path,
    `model.embed_tokens`, beside the entry given)."""
    *path, last = module.split(".")
    return last in SAVED_MODULES and set(path) <= LANGUAGE_MODEL_PATH


def _check_field_types(name: str, config: dict) -> None:
    """The fields read as numbers, lists and patterns hold such values: a hand-written or foreign config is a
    LoRAAdapterError naming the field (a 400 at the load endpoint), not a TypeError from the reader (a 500)."""

    def fail(key: str, value: object, what: str) -> LoRAAdapterError:
        return LoRAAdapterError(name, f"adapter_config.json: {key} must be {what}, got {value!r}")

    def number(key: str, value: Any, integer: bool) -> None:  # Any: JSON, checked here
        what = "a positive integer" if integer else "a finite number"
        try:  # as the reader takes them: int("8") and 8.0 pass, None, a list or NaN do not
            converted = int(value) if integer else float(value)
        except (TypeError, ValueError, OverflowError):
            raise fail(key, value, what) from None
        if isinstance(value, bool) or not math.isfinite(converted) or (integer and converted < 1):
            raise fail(key, value, what)

    number("r", config.get("r", 8), integer=True)
    number("lora_alpha", config.get("lora_alpha", 8), integer=False)
    for key, integer in (("rank_pattern", True), ("alpha_pattern", False)):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise fail(key, patterns, "an object of module patterns")
        for pattern, value in patterns.items():
            number(f"{key}[{pattern!r}]", value, integer)
            try:
                re.compile(pattern)
            except re.error as exc:
                raise fail(f"{key}'s key", pattern, f"a regular expression ({exc})") from None
    saved = config.get("modules_to_save") or []
    if not isinstance(saved, list) or not all(isinstance(module, str) for module in saved):
        raise fail("modules_to_save", saved, "a list of module names")


READ_SLICE_BYTES = 4 << 20
"""Bytes hashed between two yields of `load_peft_steps` (a few milliseconds on one core)."""

TENSORS_PER_SLICE = 96
"""Tensors taken between two yields of `load_peft_steps`."""


def load_peft_adapter(
    name: str, path: str, max_rank: int, num_layers: int, layout: AdapterLayout = AdapterLayout()
) -> LoRAWeights:
    """Read and validate `path`'s adapter (float32 on CPU; the manager copies it into its slot's dtype)."""
    return drain(load_peft_steps(name, path, max_rank, num_layers, layout=layout))


def drain(steps: Generator[None, None, LoRAWeights]) -> LoRAWeights:
    """Run a sliced load (`load_peft_steps`) to its end."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def load_peft_steps(
    name: str,
    path: str,
    max_rank: int,
    num_layers: int,
    dtype: torch.dtype = torch.float32,
    layout: AdapterLayout = AdapterLayout(),
) -> Generator[None, None, LoRAWeights]:
    """`path`'s adapter, validated (rank, targets, pairs), each module's scale folded into B and its matrices
    mapped onto the model's projections (`layout`), with the files' content hash, made in slices: the generator
    yields between slices of a few milliseconds, so that a serving engine can interleave a load with its steps
    (LoRAManager.advance_loads). A and the scaled B end in `dtype`, the slot stacks' (the scale applied in float32
    first, so the bits are those a copy into the stack gives): the conversion runs in the slices, not in the step
    that copies the adapter into a slot."""
    from safetensors import safe_open

    directory = Path(path)
    config_text = _read_config(name, directory)
    config = parse_adapter_config(name, config_text, max_rank)
    weights_file = directory / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoRAAdapterError(name, f"no adapter_model.safetensors in {path!r} (.bin adapters are not read)")
    digest = hashlib.sha256(config_text)
    # Mapped, not read into a buffer: a fresh 10 MB buffer is fresh pages to fault in and zero, which cost a
    # serving process several times the copy itself.
    with open(weights_file, "rb") as file:
        if os.fstat(file.fileno()).st_size:
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                for start in range(0, len(view), READ_SLICE_BYTES):
                    digest.update(view[start : start + READ_SLICE_BYTES])
                    yield
                view.release()
    try:
        tensors = safe_open(str(weights_file), framework="pt")
        keys = list(tensors.keys())
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise LoRAAdapterError(name, f"adapter_model.safetensors cannot be read: {exc}") from None
    adapter = LoRAWeights(name, path, rank=0, content_hash=digest.digest())
    pairs: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})  # A and B by module name
    for i, key in enumerate(keys, start=1):
        _take_tensor(adapter, pairs, key, tensors.get_tensor(key).float())
        if i % TENSORS_PER_SLICE == 0:
            yield
    lora_a, lora_b = pairs
    missing = sorted(set(lora_a).symmetric_difference(lora_b))
    if missing:
        raise LoRAAdapterError(name, f"lora_A and lora_B do not pair up at {missing[:4]}")
    experts = None if layout.experts is None else layout.experts.collect()
    for i, (module, a) in enumerate(lora_a.items(), start=1):
        b = lora_b[module]
        if a.shape[0] != b.shape[1]:
            raise LoRAAdapterError(name, f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} of {module} differ")
        found = expert_module(module)
        if found is not None:
            rank = _take_experts(name, layout, experts, module, found, a, b, config)
            pieces = []
        else:
            rank = a.shape[0]
            try:
                pieces = layout.split(module, a, b * _scale(config, module, rank))
            except UnservedModule as exc:
                raise LoRAAdapterError(name, str(exc)) from None
        if rank > max_rank:
            raise LoRARankError(name, rank, max_rank)
        _keep(adapter, module, pieces, num_layers, dtype)
        adapter.rank = max(adapter.rank, rank)
        if i % TENSORS_PER_SLICE == 0:
            yield
    if experts is not None:
        _keep(adapter, "the experts", list(experts.stacked()), num_layers, dtype)
    if not adapter.a and adapter.embed is None and adapter.lm_head is None:
        raise LoRAAdapterError(name, "the adapter file holds no LoRA matrices")
    return adapter


def _keep(
    adapter: LoRAWeights,
    module: str,
    pieces: list[tuple[int, str, torch.Tensor, torch.Tensor]],
    num_layers: int,
    dtype: torch.dtype,
) -> None:
    """Keep a module's (layer, projection, A, B) pieces, B scaled, in the slots' dtype."""
    for layer, projection, part_a, part_b in pieces:
        if layer >= num_layers:
            raise LoRAAdapterError(adapter.name, f"module {module!r} is in layer {layer}; the model has {num_layers}")
        if (layer, projection) in adapter.a:
            raise LoRAAdapterError(adapter.name, f"layer {layer}'s {projection} is adapted twice (by {module!r})")
        adapter.a[(layer, projection)] = part_a.to(dtype)
        adapter.b[(layer, projection)] = part_b.to(dtype).contiguous()


def _take_experts(
    name: str,
    layout: AdapterLayout,
    experts: Optional[ExpertPieces],
    module: str,
    found: ExpertModule,
    a: torch.Tensor,
    b: torch.Tensor,
    config: dict,
) -> int:
    """Take a module of a layer's experts (expert_layout.py); its rank (per expert)."""
    if experts is None:
        raise LoRAAdapterError(
            name, f"{module!r}: LoRA on the experts is not served on {layout.family} (only {layout.targets()})"
        )
    if not set(found.path.split(".")) <= LANGUAGE_MODEL_PATH | {""}:
        raise LoRAAdapterError(name, f"{module!r} adapts {found.path!r}, not the language model's layers")
    try:
        return experts.add(module, found, a, b, lambda key, rank: _scale(config, key, rank))
    except UnservedExperts as exc:
        raise LoRAAdapterError(name, str(exc)) from None


def _take_tensor(
    adapter: LoRAWeights, pairs: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], key: str, tensor: torch.Tensor
) -> None:
    """Keep one stored tensor: a modules_to_save matrix, or a LoRA A or B under its module's name in the base model
    (PEFT's wrapper prefix removed: model.layers.3.self_attn.q_proj)."""
    for saved in SAVED_MODULES:
        if key.endswith(f"{saved}.weight") and "lora_" not in key:
            setattr(adapter, "embed" if saved == "embed_tokens" else "lm_head", tensor.contiguous())
            return
    match = _LORA_KEY.match(key)
    if match is None:
        raise LoRAAdapterError(adapter.name, f"tensor {key!r} is neither a LoRA matrix nor {list(SAVED_MODULES)}")
    module = match.group(1).removeprefix(_PEFT_WRAPPER)
    pairs[0 if match.group(2) == "A" else 1][module] = tensor.contiguous()


def _scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of one module: alpha / r, or alpha / sqrt(r) with rsLoRA (alpha_pattern may set alpha)."""
    alpha = float(config.get("lora_alpha", 8))
    # The first key that matches, in the file's order, as PEFT's get_pattern_key picks it (not the last: a config
    # saved with sorted keys lists `layers.0.self_attn.q_proj` before the bare `q_proj` that matches it too).
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if _pattern_matches(pattern, module):
            alpha = float(value)
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _pattern_matches(pattern: str, module: str) -> bool:
    """PEFT's rank/alpha pattern match: the key as a regex against the module's full name's tail."""
    return re.match(rf"(.*\.)?({pattern})$", module) is not None
