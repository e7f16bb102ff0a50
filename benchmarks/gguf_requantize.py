"""A GGUF's weights requantized to another block format (e.g. the embedded Q4_1 model as Q8_0), for the
quality and speed rows of a format no shipped file has. Every quantized tensor is dequantized and
requantized with gguf-py (`gguf.quants`); float tensors (norms) and the metadata are copied as they are."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def requantize(source: Path, target: Path, quant: str) -> Path:
    """Write `source` with its quantized tensors in `quant` (a GGMLQuantizationType name) to `target`."""
    import gguf

    qtype = gguf.GGMLQuantizationType[quant]
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    partial = target.with_name(target.name + f".{os.getpid()}.partial")
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(partial), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        if field.name == gguf.Keys.General.FILE_TYPE:
            continue
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [rows, cols] float32
        writer.add_tensor(tensor.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, target)
    return target
