"""Random PEFT LoRA adapters for a checkpoint directory, written the way `peft` saves trained ones."""

from __future__ import annotations

from pathlib import Path

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(model_dir: Path, out_dir: Path, *, rank: int, seed: int) -> Path:
    """A rank-`rank` adapter on every attention and MLP projection with random A and B (init_lora_weights=False:
    B is not zero, so the adapter changes the model's output), saved to `out_dir` (adapter_config.json +
    adapter_model.safetensors)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJECTIONS), init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(out_dir)
    return out_dir
