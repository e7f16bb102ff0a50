"""Tiny Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints written as GGUF files the way llama.cpp's converter lays them
out: names from gguf-py's own tensor map (not pagedserve's), experts stacked [E, rows, cols] per projection, the
expert metadata keys, llama's q/k row permutation for Mixtral (`llama` to llama.cpp)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from tests.engine.factories import _llama_cpp_permute, _write_gguf_hparams, _write_gguf_tokenizer

GGUF_ARCHITECTURES = {"mixtral": "LLAMA", "qwen2_moe": "QWEN2MOE", "qwen3_moe": "QWEN3MOE"}
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)")


def make_tiny_moe_gguf(model_dir: Path, gguf_path: Path, expert_type: str = "F32", matrix_type: str = "F32") -> Path:
    """The HF checkpoint at `model_dir` as a GGUF: stacked experts in `expert_type`, the shared expert's matrices
    in `matrix_type`, everything else F32 (GGML type names: "F32", "Q8_0", "Q4_0", ...)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    arch = gguf.MODEL_ARCH[GGUF_ARCHITECTURES[config["model_type"]]]
    writer = gguf.GGUFWriter(str(gguf_path), gguf.MODEL_ARCH_NAMES[arch])
    _write_gguf_hparams(writer, config)
    _write_moe_hparams(writer, config)
    _write_gguf_tokenizer(writer, model_dir)
    layers = config["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(arch, layers)
    state = load_file(str(model_dir / "model.safetensors"))
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in state.items():
        base, suffix = name.rsplit(".", 1)
        array = tensor.float().numpy()
        expert = _EXPERT.fullmatch(base)
        if expert is not None:  # stacked below, as llama.cpp's converter does
            prefix, index, part = expert.groups()
            stacks.setdefault(f"{prefix}.{part}", {})[int(index)] = array
            continue
        if arch == gguf.MODEL_ARCH.LLAMA and base.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads" if base.endswith("q_proj") else "num_key_value_heads"]
            array = _llama_cpp_permute(array, heads)
        if base.endswith("shared_expert_gate"):
            array = array.reshape(-1)  # llama.cpp's [H]
        qtype = matrix_type if ".shared_expert." in base else "F32"
        _add(writer, f"{name_map.get_name(base)}.{suffix}", array, qtype)
    for base, experts in stacks.items():
        stacked = np.stack([experts[e] for e in range(len(experts))])  # [E, rows, cols]
        _add(writer, f"{name_map.get_name(base)}.weight", stacked, expert_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def dequantized(array: np.ndarray, type_name: str) -> np.ndarray:
    """What a float array reads back as from a GGUF tensor of `type_name` (rows of 32-blocks)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    if type_name == "F32":
        return array
    qtype = GGMLQuantizationType[type_name]
    return dequantize(quantize(array, qtype), qtype).reshape(array.shape)


def _add(writer, name: str, array: np.ndarray, type_name: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if type_name == "F32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        return
    qtype = GGMLQuantizationType[type_name]
    writer.add_tensor(name, quantize(np.ascontiguousarray(array, dtype=np.float32), qtype), raw_dtype=qtype)


def _write_moe_hparams(writer, config: dict) -> None:
    experts = config.get("num_local_experts") or config["num_experts"]
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if config["model_type"] == "qwen3_moe":
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
