"""Random PEFT adapters over a base checkpoint, and the base with adapters merged: the references LoRA
serving must match (PEFT's own merge_and_unload, so scaling, rsLoRA and modules_to_save are PEFT's)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from engine.lora.peft_adapter import LoRAWeights
from engine.models.llama_arch import LlamaArch

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
    targets: Union[str, Sequence[str]] = ALL_TARGETS,
    target_parameters: Optional[list[str]] = None,
    use_rslora: bool = False,
    use_dora: bool = False,
    modules_to_save: Optional[list[str]] = None,
    weight_scale: float = 1.0,
    alpha_pattern: Optional[dict[str, float]] = None,
    ensure_weight_tying: bool = False,
    merge: bool = False,
    keep: bool = False,
):
    """A PEFT LoRA adapter with random A and B (so its deltas change the outputs), saved to `out_dir`.
    `weight_scale` multiplies B (the embedded model's wide layers need smaller deltas to stay sensible).
    Returns the directory, or with `merge` (directory, the PEFT model merged: merge_and_unload), or with `keep`
    (directory, the PEFT model itself, which adds the deltas in its own forward: no merge, seconds faster on
    the embedded model)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets if isinstance(targets, str) else list(targets),  # ("all-linear": PEFT's choice)
        target_parameters=target_parameters,  # (a mixture of experts' stacked experts)
        use_rslora=use_rslora,
        use_dora=use_dora,
        modules_to_save=modules_to_save,
        init_lora_weights=False,
        alpha_pattern=alpha_pattern or {},
        ensure_weight_tying=ensure_weight_tying,
    )
    model = get_peft_model(_base(base_dir), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(weight_scale)
            elif "modules_to_save" in name:  # a replacement that differs from the base's matrix
                param.add_(torch.randn_like(param) * param.std())
    model.save_pretrained(str(out_dir))
    if merge:
        return out_dir, model.merge_and_unload().eval()
    return (out_dir, model.eval()) if keep else out_dir


def merged_model(base_dir: Path, adapters: Sequence[tuple[Path, float]]):
    """The base (an HF model in float32) with each adapter merged by PEFT (merge_and_unload), its change scaled:
    W + sum(s_i * dW_i)."""
    from peft import PeftModel

    base = _base(base_dir)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    total = {k: v.clone() for k, v in base_state.items()}
    for path, scale in adapters:
        merged = PeftModel.from_pretrained(_base(base_dir), str(path)).merge_and_unload()
        for key, value in merged.state_dict().items():
            total[key] += scale * (value - base_state[key])
    base.load_state_dict(total)
    return base.eval()


def merged_model_dir(base_dir: Path, adapters: Sequence[tuple[Path, float]], out_dir: Path) -> Path:
    """`merged_model` saved to `out_dir` (for references.check_against_hf)."""
    merged_model(base_dir, adapters).save_pretrained(str(out_dir))
    return out_dir


# A small Llama shape for the step-level tests (no checkpoint).
ARCH = LlamaArch(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=1e4,
    rope_scaling=None,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    sliding_window=None,
)


def random_weights(name: str, rank: int, seed: int, skip: str) -> LoRAWeights:
    """Random LoRAWeights over ARCH's projections (all but `skip`), as the loader would hold them."""
    generator = torch.Generator().manual_seed(seed)
    widths = {
        "q_proj": (32, 32),
        "k_proj": (32, 16),
        "v_proj": (32, 16),
        "o_proj": (32, 32),
        "gate_proj": (32, 48),
        "up_proj": (32, 48),
        "down_proj": (48, 32),
    }
    adapter = LoRAWeights(name, "", rank)
    for layer in range(ARCH.num_layers):
        for proj, (width, out) in widths.items():
            if proj != skip:
                adapter.a[(layer, proj)] = torch.randn(rank, width, generator=generator)
                adapter.b[(layer, proj)] = torch.randn(out, rank, generator=generator)
    return adapter
