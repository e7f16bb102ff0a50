"""A PEFT adapter written as llama.cpp's convert_lora_to_gguf.py writes it: the file the engine's GGUF reader
must read back into the PEFT adapter's own deltas."""

from __future__ import annotations

import json
from pathlib import Path

from tests.engine.factories import _llama_cpp_permute


def write_gguf_adapter(peft_dir: Path, path: Path, *, num_heads: int, num_kv_heads: int, num_layers: int) -> Path:
    """`peft_dir`'s adapter (a llama base) as a GGUF LoRA adapter at `path`: general.type adapter, adapter.type
    lora, adapter.lora.alpha = lora_alpha; `blk.{i}.attn_q.weight.lora_a` [rank, in] and `.lora_b` [out, rank]
    in float32; lora_b's rows of attn_q / attn_k in llama.cpp's RoPE order (the converter permutes B only)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((peft_dir / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, num_layers)
    for key, tensor in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        module, which = key.removeprefix("base_model.model.").rsplit(".lora_", 1)  # model.layers.0.self_attn.q_proj
        array = tensor.float().numpy()
        if which.startswith("B") and module.endswith(("q_proj", "k_proj")):
            array = _llama_cpp_permute(array, num_heads if module.endswith("q_proj") else num_kv_heads)
        suffix = "lora_a" if which.startswith("A") else "lora_b"
        writer.add_tensor(f"{name_map.get_name(module)}.weight.{suffix}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
