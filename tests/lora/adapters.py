"""Random PEFT adapters over a base checkpoint, and the base with adapters merged: the references LoRA
serving must match (PEFT's own merge_and_unload, so scaling, rsLoRA and modules_to_save are PEFT's)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _base(base_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    seed: int,
    r: int = 4,
    alpha: float = 8,
    targets: Sequence[str] = ALL_TARGETS,
    use_rslora: bool = False,
    use_dora: bool = False,
    modules_to_save: Optional[list[str]] = None,
    weight_scale: float = 1.0,
) -> Path:
    """A PEFT LoRA adapter with random A and B (so its deltas change the outputs), saved to `out_dir`.
    `weight_scale` multiplies B (the embedded model's wide layers need smaller deltas to stay sensible)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        use_dora=use_dora,
        modules_to_save=modules_to_save,
        init_lora_weights=False,
    )
    model = get_peft_model(_base(base_dir), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(weight_scale)
            elif "modules_to_save" in name:  # a replacement that differs from the base's matrix
                param.add_(torch.randn_like(param) * param.std())
    model.save_pretrained(str(out_dir))
    return out_dir


def merged_model_dir(base_dir: Path, adapters: Sequence[tuple[Path, float]], out_dir: Path) -> Path:
    """The base with each adapter merged by PEFT (merge_and_unload), its change scaled: W + sum(s_i * dW_i)."""
    from peft import PeftModel

    base = _base(base_dir)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    total = {k: v.clone() for k, v in base_state.items()}
    for path, scale in adapters:
        merged = PeftModel.from_pretrained(_base(base_dir), str(path)).merge_and_unload()
        for key, value in merged.state_dict().items():
            total[key] += scale * (value - base_state[key])
    base.load_state_dict(total)
    base.save_pretrained(str(out_dir))
    return out_dir
