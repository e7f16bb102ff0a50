"""Reading a `.gguf` file's tensors under HF state-dict names, Q4_0/Q4_1/Q8_0 matrices kept quantized.

The config and tokenizer still come from the converted checkpoint directory (gguf_converter.py); only
the weights are read here, straight from the GGUF with `gguf.GGUFReader` (memory-mapped):

    Q4_0, Q4_1, Q8_0 2-D     -> GgufWeight (repacked blocks, gguf_formats.py)
    other quantized 2-D      -> GgufWeight, carried into Q4_1 (Q4_K) or Q8_0 blocks (gguf_transcode.py, logged)
    F32, F16, BF16           -> float tensors, as the converted checkpoint has them
    other quantized 1-D      -> dequantized to float32 by `gguf.quants.dequantize` (and 2-D ones whose
                                scales do not fit in fp16)

llama.cpp's converter permutes the rows of attn_q / attn_k of `llama` models for its RoPE layout; they
are permuted back as HF's GGUF loader does (whole rows, so whole rows of blocks: exact on quantized data):

    stored rows [heads, half, 2] -> [heads, 2, half]     (heads = kv heads for attn_k)
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterator, Union

import numpy as np
import torch

from engine.kernels.quant import QuantKernels
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


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF state-dict name (KeyError for tensors the Llama family does not have)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise KeyError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")
    index, part, kind = match.groups()
    return f"model.layers.{index}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order undoing llama.cpp's q/k permutation: new row i = stored row order[i]."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def _heads_for(gguf_name: str, architecture: str, num_heads: int, num_kv_heads: int) -> int:
    """Heads to un-permute by (0: leave the rows as stored)."""
    if architecture != "llama" or not gguf_name.endswith(".weight"):
        return 0
    if ".attn_q." in gguf_name:
        return num_heads
    if ".attn_k." in gguf_name:
        return num_kv_heads
    return 0


def iter_gguf_weights(
    path: Union[str, Path], kernels: QuantKernels, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, Union[torch.Tensor, GgufWeight]]]:
    """(HF name, tensor or GgufWeight) for every tensor of the GGUF at `path`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else "llama"
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        heads = _heads_for(tensor.name, architecture, num_heads, num_kv_heads)
        value = _read_tensor(tensor, kernels)
        if heads:
            order = unpermute_rows(value.out_features if isinstance(value, GgufWeight) else value.shape[0], heads)
            value = value.take_rows(order) if isinstance(value, GgufWeight) else value[order].contiguous()
        yield name, value


def _read_tensor(tensor, kernels: QuantKernels) -> Union[torch.Tensor, GgufWeight]:
    from gguf.quants import dequantize

    type_name = tensor.tensor_type.name
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    fmt = FORMATS.get(type_name.lower())
    if fmt is not None and len(shape) == 2:
        return GgufWeight(fmt, repack(fmt, np.asarray(tensor.data), shape[1]), shape[1], kernels)
    if type_name in _FLOAT_TYPES:
        return torch.from_numpy(np.array(tensor.data)).view(_FLOAT_TYPES[type_name]).reshape(shape)
    carried = transcode(type_name, np.asarray(tensor.data).reshape(shape[0], -1), shape[1]) if len(shape) == 2 else None
    if carried is not None:
        fmt, packed = carried
        logger.info("GGUF tensor %s (%s) is kept as %s blocks", tensor.name, type_name, fmt.name.upper())
        return GgufWeight(fmt, packed, shape[1], kernels)
    logger.info("GGUF tensor %s (%s) is dequantized to float32", tensor.name, type_name)
    return torch.from_numpy(dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)).reshape(shape)
