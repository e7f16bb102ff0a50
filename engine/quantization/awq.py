"""AWQ int4 checkpoints (AutoAWQ's GEMM format), read into `Int4Groups`.

Per linear layer `<prefix>` the checkpoint stores, instead of `<prefix>.weight`:

    qweight  int32 [in, out / 8]          8 codes per int32, columns in AWQ's order:
    qzeros   int32 [in / G, out / 8]      nibble i (bits 4i .. 4i+3) holds column AWQ_ORDER[i]
    scales   fp16  [in / G, out]          W.T[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]

and config.json says `quantization_config: {quant_method: awq, version: gemm, bits: 4, group_size: G,
zero_point: true}`. Embeddings, norms and the LM head stay float.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Union

import torch

from engine.quantization.int4_groups import INT4_GROUP_SIZES, Int4Groups

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_PARTS = ("qweight", "qzeros", "scales")


def quantization_config(hf_config: Any) -> Optional[dict]:
    """The checkpoint's `quantization_config` as a dict (None for a float checkpoint)."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    return dict(config) if isinstance(config, dict) else dict(config.to_dict())


def awq_group_size(config: dict) -> int:
    """The group size of a supported AWQ config; ValueError naming what is not supported."""
    problems = []
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        problems.append(f"version {version!r} (only 'gemm' is read; gemv, marlin and exllama layouts are not)")
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        problems.append(f"bits {bits!r} (only 4)")
    if not config.get("zero_point", True):
        problems.append("zero_point false (only AWQ with zero points)")
    group_size = config.get("group_size", config.get("q_group_size"))
    if group_size not in INT4_GROUP_SIZES:
        problems.append(f"group_size {group_size!r} (only {', '.join(map(str, INT4_GROUP_SIZES))})")
    if problems:
        raise ValueError("--quantization awq: this AWQ checkpoint is not supported: " + "; ".join(problems))
    assert group_size is not None  # one of INT4_GROUP_SIZES, checked above
    return int(group_size)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] in AWQ's column order -> uint8 codes [rows, cols]."""
    rows, packs = packed.shape
    shifts = torch.tensor([4 * AWQ_ORDER.index(j) for j in range(8)], dtype=torch.int32)
    codes = (packed.to(torch.int32)[..., None] >> shifts) & 15  # [rows, packs, 8], column 8p + j
    return codes.view(rows, packs * 8).to(torch.uint8)


def awq_to_groups(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Groups:
    """One AWQ linear layer as [out, in] `Int4Groups`."""
    codes = unpack_awq(qweight)  # [in, out]
    zero_codes = unpack_awq(qzeros)  # [in / G, out]
    in_features, out_features = codes.shape
    if scales.shape != zero_codes.shape or in_features != scales.shape[0] * group_size:
        raise ValueError(
            f"AWQ tensors do not agree with group size {group_size}: qweight {tuple(qweight.shape)}, "
            f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
        )
    return Int4Groups.from_zero_codes(codes.t(), scales.t().float(), zero_codes.t(), group_size)


def awq_weights(
    weights: Iterable[tuple[str, torch.Tensor]], group_size: int
) -> Iterator[tuple[str, Union[torch.Tensor, Int4Groups]]]:
    """A checkpoint's tensors with every AWQ triple turned into `<prefix>.weight` -> `Int4Groups`."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in AWQ_PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == len(AWQ_PARTS):
            del pending[prefix]
            yield f"{prefix}.weight", awq_to_groups(parts["qweight"], parts["qzeros"], parts["scales"], group_size)
    if pending:
        prefix, parts = next(iter(pending.items()))
        raise ValueError(f"AWQ layer {prefix} lacks {', '.join(p for p in AWQ_PARTS if p not in parts)}")
