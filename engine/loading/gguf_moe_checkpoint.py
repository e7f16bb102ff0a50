"""A llama.cpp mixture-of-experts GGUF (Mixtral, Qwen2-MoE, Qwen3-MoE) converted into an HF checkpoint directory.

transformers' GGUF reader turns the keys every family shares into a config (context_length, block_count,
embedding_length, head counts, rope.freq_base, ...) but not the experts: to llama.cpp Mixtral is `llama` with
`llama.expert_count` set (transformers would build a dense Llama of it), and the Qwen MoE expert widths are not
read. Here the config is transformers' reading of the shared keys plus the experts from the GGUF's own keys:

    general.architecture          llama (experts)      qwen2moe                           qwen3moe
    model_type                    mixtral              qwen2_moe                          qwen3_moe
    {arch}.expert_count           num_local_experts    num_experts                        num_experts
    {arch}.expert_used_count      num_experts_per_tok  num_experts_per_tok                num_experts_per_tok
    expert_feed_forward_length    intermediate_size    moe_intermediate_size              moe_intermediate_size
    expert_shared_feed_forward_length                  shared_expert_intermediate_size
    expert_weights_norm           must be true         norm_topk_prob (absent: false)     norm_topk_prob (absent: true)
    layers without ffn_gate_inp   refused              mlp_only_layers                    mlp_only_layers

(absent `expert_weights_norm`: what llama.cpp's own graph for the architecture does). The weights are the
GGUF's, dequantized to float32 under HF names (gguf_weights.py, stacked experts cut per expert); the tokenizer
is transformers' conversion of the GGUF's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

MOE_MODEL_TYPES = {
    "llama": ("mixtral", "MixtralForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
_RENORMALIZE = {"llama": True, "qwen2moe": False, "qwen3moe": True}  # llama.cpp's graphs' norm_w


def moe_architecture(gguf_path: Path) -> Optional[str]:
    """The GGUF's `general.architecture` when it is a mixture of experts converted here, else None."""
    from engine.loading.gguf_reader import read_gguf

    reader = read_gguf(gguf_path)
    architecture = _field(reader, "general.architecture")
    if architecture not in MOE_MODEL_TYPES or not _field(reader, f"{architecture}.expert_count"):
        return None
    return architecture


def moe_config(gguf_path: Path, architecture: str) -> dict[str, Any]:
    """The HF config (as a dict for `AutoConfig.for_model`) of the mixture-of-experts GGUF at `gguf_path`."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.loading.gguf_reader import read_gguf

    config = dict(load_gguf_checkpoint(str(gguf_path), return_tensors=False)["config"])
    config.pop("_model_name_or_path", None)
    reader = read_gguf(gguf_path)

    def key(name: str) -> Any:
        return _field(reader, f"{architecture}.{name}")

    model_type, hf_architecture = MOE_MODEL_TYPES[architecture]
    renormalize = key("expert_weights_norm")
    renormalize = _RENORMALIZE[architecture] if renormalize is None else bool(renormalize)
    layers = config["num_hidden_layers"]
    routed = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.endswith(".ffn_gate_inp.weight")}
    dense = [i for i in range(layers) if i not in routed]
    config.update(model_type=model_type, architectures=[hf_architecture], num_experts_per_tok=key("expert_used_count"))
    if architecture == "llama":
        if dense or not renormalize:
            what = f"layers {dense} without experts" if dense else "expert_weights_norm false"
            raise ValueError(f"a Mixtral GGUF (llama with experts) with {what} is not supported")
        config.update(num_local_experts=key("expert_count"))
        config["intermediate_size"] = key("expert_feed_forward_length") or config["intermediate_size"]
        return config
    config.update(
        num_experts=key("expert_count"),
        moe_intermediate_size=key("expert_feed_forward_length"),
        norm_topk_prob=renormalize,
        decoder_sparse_step=1,
        mlp_only_layers=dense,
    )
    if architecture == "qwen2moe":
        config["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length") or 0
    return config


def convert_moe_gguf(gguf_path: Path, architecture: str, out_dir: Path) -> None:
    """Write config.json, model.safetensors (float32), generation_config.json and the tokenizer to `out_dir`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from engine.loading.gguf_weights import iter_gguf_weights

    config = AutoConfig.for_model(**moe_config(gguf_path, architecture))
    config.save_pretrained(out_dir)
    ids = {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(out_dir)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    tensors = {
        name: torch.as_tensor(value).to(torch.float32).contiguous()
        for name, value in iter_gguf_weights(gguf_path, None, heads, kv_heads)
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out_dir)


def _field(reader, name: str) -> Any:
    field = reader.fields.get(name)
    return None if field is None else field.contents()
