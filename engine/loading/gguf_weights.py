"""Reading a `.gguf` file's tensors under HF state-dict names, Q4_0/Q4_1/Q8_0 matrices kept quantized.

The config and tokenizer still come from the converted checkpoint directory (gguf_converter.py); only
the weights are read here, straight from the GGUF (gguf_reader.py, memory-mapped):

    Q4_0, Q4_1, Q8_0 2-D     -> GgufWeight (repacked blocks, gguf_formats.py)
    other quantized 2-D      -> GgufWeight, carried into Q4_1 (Q4_K) or Q8_0 blocks (gguf_transcode.py, logged)
    F32, F16, BF16           -> float tensors, as the converted checkpoint has them
    other quantized 1-D      -> dequantized to float32 by `gguf.quants.dequantize` (and 2-D ones whose
                                scales do not fit in fp16)
    stacked experts 3-D      -> one matrix per expert, each read as above (gguf_experts.py)

Without kernels (`kernels=None`: the conversion into a float checkpoint) every tensor is read as floats.

llama.cpp's converter permutes the rows of attn_q / attn_k of `llama` models for its RoPE layout; they
are permuted back as HF's GGUF loader does (whole rows, so whole rows of blocks: exact on quantized data):

    stored rows [heads, half, 2] -> [heads, 2, half]     (heads = kv heads for attn_k)
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import torch

from engine.kernels.quant import QuantKernels
from engine.loading.gguf_experts import STACKS, expert_name, moe_layer_name, split_stack
from engine.loading.gguf_rope_freqs import ROPE_FREQS
from engine.quantization.gguf_formats import FORMATS, repack
from engine.quantization.gguf_transcode import transcode
from engine.quantization.gguf_weight import GgufWeight

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """GGUF tensor name -> HF state-dict name (KeyError for tensors the Llama family and its mixtures of experts
    do not have; the stacked experts, which become several, go through `expert_name`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    layer_name = (
        None if match is None else _LAYER_NAMES.get(match.group(2)) or moe_layer_name(match.group(2), architecture)
    )
    if match is None or layer_name is None:
        raise KeyError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")
    return f"model.layers.{match.group(1)}.{layer_name}.{match.group(3)}"


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order undoing llama.cpp's q/k permutation: new row i = stored row order[i]."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def permuted_heads(gguf_name: str, architecture: str, num_heads: int, num_kv_heads: int) -> int:
    """Heads to un-permute `gguf_name`'s rows by (0: leave the rows as stored); a LoRA adapter's lora_b rows
    are permuted as its base tensor's are (engine/lora/gguf_adapter.py)."""
    if architecture != "llama" or not gguf_name.endswith(".weight"):
        return 0
    if ".attn_q." in gguf_name:
        return num_heads
    if ".attn_k." in gguf_name:
        return num_kv_heads
    return 0


def iter_gguf_weights(
    path: Union[str, Path], kernels: Optional[QuantKernels], num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, Union[torch.Tensor, GgufWeight]]]:
    """(HF name, tensor or GgufWeight) for every tensor of the GGUF at `path` (all floats without kernels)."""
    from engine.loading.gguf_reader import read_gguf

    reader = read_gguf(path, arrays=False)
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else "llama"
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # the converted config's llama3 RoPE scaling (engine/loading/gguf_rope_freqs.py)
        match = _LAYER.fullmatch(tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        if match is not None and match.group(2) in STACKS:
            index, part, kind = match.groups()
            for expert, data in enumerate(split_stack(np.asarray(tensor.data), shape)):
                name = f"model.layers.{index}.{expert_name(part, architecture, expert)}.{kind}"
                yield name, _read_array(f"{tensor.name}[{expert}]", tensor.tensor_type, data, shape[1:], kernels)
            continue
        name = hf_name(tensor.name, architecture)
        heads = permuted_heads(tensor.name, architecture, num_heads, num_kv_heads)
        value = _read_array(tensor.name, tensor.tensor_type, np.asarray(tensor.data), shape, kernels)
        if heads:
            order = unpermute_rows(value.out_features if isinstance(value, GgufWeight) else value.shape[0], heads)
            value = value.take_rows(order) if isinstance(value, GgufWeight) else value[order].contiguous()
        if name.endswith("shared_expert_gate.weight") and isinstance(value, torch.Tensor):
            value = value.reshape(1, -1)  # llama.cpp's [H], HF's [1, H]
        yield name, value


def read_float(tensor) -> torch.Tensor:
    """A GGUFReader tensor as a float32 tensor of its logical shape (any type dequantized)."""
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    value = _read_array(tensor.name, tensor.tensor_type, np.asarray(tensor.data), shape, None)
    assert isinstance(value, torch.Tensor)  # (no kernels: floats)
    return value.float()


def _read_array(
    name: str, tensor_type, data: np.ndarray, shape: tuple[int, ...], kernels: Optional[QuantKernels]
) -> Union[torch.Tensor, GgufWeight]:
    """One tensor's data (float elements or rows of blocks) of logical `shape`, in the form the table above says."""
    from gguf.quants import dequantize

    type_name = tensor_type.name
    fmt = FORMATS.get(type_name.lower())
    if type_name in _FLOAT_TYPES:
        return torch.from_numpy(np.array(data)).view(_FLOAT_TYPES[type_name]).reshape(shape)
    if fmt is not None and len(shape) == 2 and kernels is not None:
        return GgufWeight(fmt, repack(fmt, data.reshape(shape[0], -1), shape[1]), shape[1], kernels)
    keep = len(shape) == 2 and kernels is not None
    carried = transcode(type_name, data.reshape(shape[0], -1), shape[1]) if keep else None
    if carried is not None:
        assert kernels is not None  # `keep` above
        fmt, packed = carried
        logger.info("GGUF tensor %s (%s) is kept as %s blocks", name, type_name, fmt.name.upper())
        return GgufWeight(fmt, packed, shape[1], kernels)
    if kernels is not None:
        logger.info("GGUF tensor %s (%s) is dequantized to float32", name, type_name)
    return torch.from_numpy(dequantize(data, tensor_type).astype(np.float32)).reshape(shape)
