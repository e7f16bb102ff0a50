"""A mixture of experts' PEFT adapter (`target_parameters` on the stacked experts) rewritten: without its expert
matrices, or in the per-expert module form (`experts.{e}.w1|w3|w2`, what older transformers' per-expert linears
gave PEFT and vLLM's loader reads), each expert's A and B cut out of the stacked ones as PEFT's ParamWrapper
reads them (A's rows [e r, (e + 1) r), B's columns e, e + E, ...)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def _copy(adapter: Path, out_dir: Path, tensors: dict, **config_changes) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(config_changes)
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return out_dir


def without_experts(adapter: Path, out_dir: Path) -> Path:
    """The adapter's other modules alone (its attention)."""
    tensors = {k: v for k, v in load_file(str(adapter / "adapter_model.safetensors")).items() if ".experts." not in k}
    return _copy(adapter, out_dir, tensors, target_parameters=None)


def as_per_expert_modules(
    adapter: Path, out_dir: Path, num_experts: int, hidden: int, block: str, names: tuple[str, str, str]
) -> Path:
    """The same deltas as per-expert modules `<block>.experts.{e}.<gate|up|down name>` (one rank r per expert)."""
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    modules = {k.removesuffix(".lora_A.weight") for k in tensors if ".experts." in k and k.endswith("lora_A.weight")}
    gate, up, down = names
    for module in modules:
        a, b = tensors[module + ".lora_A.weight"], tensors[module + ".lora_B.weight"]  # [E r, in], [out, r E]
        prefix = module.replace(".base_layer", "").replace(".mlp.experts", f".{block}.experts")
        r = a.shape[0] // num_experts
        for e in range(num_experts):
            a_e, b_e = a[e * r : (e + 1) * r], b[:, e::num_experts]  # [r, in], [out, r]
            if a.shape[1] == hidden:  # gate_up_proj: B's gate rows, then its up rows
                parts = {gate: b_e[: b_e.shape[0] // 2], up: b_e[b_e.shape[0] // 2 :]}
            else:
                parts = {down: b_e}
            for name, rows in parts.items():
                out[f"{prefix}.{e}.{name}.lora_A.weight"] = a_e.clone()
                out[f"{prefix}.{e}.{name}.lora_B.weight"] = rows.clone()
    config = json.loads((adapter / "adapter_config.json").read_text())
    return _copy(adapter, out_dir, out, target_parameters=None, target_modules=config["target_modules"] + list(names))


def copy_adapter(adapter: Path, out_dir: Path, **config_changes) -> Path:
    """The adapter with its config changed."""
    return _copy(adapter, out_dir, load_file(str(adapter / "adapter_model.safetensors")), **config_changes)
