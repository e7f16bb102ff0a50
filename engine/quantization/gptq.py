"""GPTQ checkpoints (AutoGPTQ / GPTQModel's "gptq" format), read into `Int4Groups` or dequantized at load.

Per linear layer `<prefix>` the checkpoint stores, instead of `<prefix>.weight` (b bits, P = 32 / b codes per int32,
G the group size, g = g_idx):

    qweight  int32 [in / P, out]          packed along the INPUT dim: bits b*j .. b*j+b-1 of row r hold input P*r + j
    qzeros   int32 [in / G, out / P]      packed along the OUTPUT dim, low bits first
    scales   fp16  [in / G, out]          W.T[k, n] = (q[k, n] - z[g[k], n]) * s[g[k], n]
    g_idx    int32 [in]                   the group of each input column: k // G, or with desc_act (activation order)
                                          the group of k's place in the order GPTQ quantized the columns in

AutoGPTQ's format (checkpoint_format "gptq", the default: "v1") stores z - 1, wrapped to b bits: the zero read
back is (stored + 1) mod 2^b, as AutoGPTQ's own dequantization and GPTQModel's v1 -> v2 conversion read it (a
real zero of 0 is stored as 2^b - 1). "gptq_v2" stores z itself.

How a layer is served (`GptqConfig.int4_group_size`):
- 4 bits, G of 32/64/128, no desc_act: `Int4Groups` with exactly the stored codes, zeros and scales (the int4
  kernels, as AWQ). A g_idx other than k // G there is an inconsistent checkpoint: refused by name.
- anything else served (8 bits: no int8 path has per-group scales; G = -1, one group over the whole input width,
  or a size the int4 kernels do not take; desc_act, whose groups are scattered over the input columns): the
  matrix dequantized to floats at load (exact: the products then run on float weights, at the model dtype's
  memory, 4x (8x in float32) an int4 matrix's). Permuting the input columns instead would keep int4 but every
  activation would need the same permutation before each product, tensor-parallel cuts included.
Bias tensors pass as stored; an LM head stored quantized (GPTQModel's `lm_head: true`) is dequantized (the model
keeps its head in floats).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Union

import torch

from engine.quantization.int4_groups import INT4_GROUP_SIZES, Int4Groups

logger = logging.getLogger(__name__)

GPTQ = "gptq"
GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
SERVED_BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True, slots=True)
class GptqConfig:
    """The parts of config.json's `quantization_config` that say how the tensors read."""

    bits: int
    group_size: Optional[int]  # None: one group over the whole input width (the checkpoint's -1)
    desc_act: bool
    v2: bool  # zeros stored as they are (gptq_v2); else as zero - 1 (AutoGPTQ's v1)

    @classmethod
    def from_config(cls, config: dict) -> "GptqConfig":
        """ValueError naming everything in `config` that is not served."""
        problems = []
        bits = config.get("bits")
        if bits not in SERVED_BITS:
            problems.append(f"bits {bits!r} (only 4 and 8)")
        group_size = config.get("group_size", 128)
        if not isinstance(group_size, int) or (group_size != -1 and group_size < 1):
            problems.append(f"group_size {group_size!r}")
        fmt = str(config.get("checkpoint_format") or "gptq").lower()
        if fmt not in CHECKPOINT_FORMATS:
            problems.append(
                f"checkpoint_format {fmt!r} (only {' and '.join(CHECKPOINT_FORMATS)}: marlin, bitblas "
                "and other repacked layouts are not read)"
            )
        if config.get("is_marlin_format"):
            problems.append("is_marlin_format true (Marlin's repacked layout is not read)")
        if config.get("dynamic"):
            problems.append("dynamic (per-module bits and group sizes)")
        if problems:
            raise ValueError("--quantization gptq: this GPTQ checkpoint is not supported: " + "; ".join(problems))
        assert isinstance(bits, int)  # one of SERVED_BITS (checked above)
        return cls(bits, None if group_size == -1 else group_size, bool(config.get("desc_act")), fmt == "gptq_v2")

    @property
    def int4_group_size(self) -> Optional[int]:
        """The group size its matrices are served in as `Int4Groups`; None: they are dequantized at load."""
        if self.bits == 4 and self.group_size in INT4_GROUP_SIZES and not self.desc_act:
            return self.group_size
        return None

    def describe(self) -> str:
        """How the matrices are served, and why (for the start-up log)."""
        what = f"GPTQ {self.bits}-bit, group size {self.group_size or 'whole rows'}"
        if self.int4_group_size is not None:
            return f"{what}: kept as int4 groups (served by the int4 kernels)"
        reasons = []
        if self.bits != 4:
            reasons.append(f"{self.bits}-bit groups have no quantized product here")
        elif self.group_size not in INT4_GROUP_SIZES:
            reasons.append(f"the int4 kernels take groups of {', '.join(map(str, INT4_GROUP_SIZES))}")
        if self.desc_act:
            reasons.append("desc_act scatters each group over the input columns")
        return f"{what}: dequantized to the model's dtype at load ({'; '.join(reasons)})"


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [n / P, m] -> int32 codes [n, m]: P = 32 / bits codes per int32 down the rows, low bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)  # [P]
    codes = (packed.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)  # [n / P, P, m]
    return codes.reshape(-1, packed.shape[1])


def unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [n, m / P] -> int32 codes [n, m]: P codes per int32 along the row, low bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.unsqueeze(2) >> shifts) & ((1 << bits) - 1)  # [n, m / P, P]
    return codes.reshape(packed.shape[0], -1)


def gptq_matrix(
    prefix: str, parts: dict[str, torch.Tensor], config: GptqConfig, dequantize: bool = False
) -> Union[Int4Groups, torch.Tensor]:
    """One GPTQ linear layer as [out, in] `Int4Groups`, or float32 [out, in] where it is dequantized (its config
    says so, or `dequantize`)."""
    bits = config.bits
    codes = unpack_rows(parts["qweight"], bits)  # [in, out]
    zeros = unpack_columns(parts["qzeros"], bits)  # [groups, out]
    if not config.v2:
        zeros = (zeros + 1) & ((1 << bits) - 1)
    scales = parts["scales"]  # [groups, out]
    in_features, out_features = codes.shape
    group = config.group_size or in_features
    num_groups = -(-in_features // group)
    if scales.shape != (num_groups, out_features) or zeros.shape != scales.shape:
        raise ValueError(
            f"GPTQ layer {prefix}: tensors do not agree with {bits} bits and group size {group}: qweight "
            f"{tuple(parts['qweight'].shape)}, qzeros {tuple(parts['qzeros'].shape)}, scales {tuple(scales.shape)}"
        )
    ordered = torch.arange(in_features) // group
    g_idx = parts.get("g_idx")
    g = ordered if g_idx is None else g_idx.long()
    if g.shape != (in_features,) or int(g.min()) < 0 or int(g.max()) >= num_groups:
        raise ValueError(f"GPTQ layer {prefix}: g_idx is not {in_features} group indices below {num_groups}")
    int4 = config.int4_group_size
    if int4 is not None and not dequantize:
        if not torch.equal(g, ordered):
            raise ValueError(
                f"GPTQ layer {prefix}: g_idx is not input // group_size although quantization_config says "
                "desc_act false; the checkpoint's config does not describe its tensors"
            )
        return _int4_groups(codes, scales, zeros, int4)
    # [in, out] -> [out, in]: each input column k scaled and offset by its own group g[k]'s
    weight = (codes - zeros[g]).float() * scales[g].float()
    return weight.t().contiguous()


def _int4_groups(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> Int4Groups:
    """Stored codes [in, out] as Int4Groups; an input width that is not whole groups padded with code 0 columns
    (the product multiplies them by zero activations)."""
    in_features = codes.shape[0]
    padded = scales.shape[0] * group
    codes = torch.nn.functional.pad(codes.t(), (0, padded - in_features))
    groups = Int4Groups.from_zero_codes(codes, scales.t().float(), zeros.t(), group)
    return dataclasses.replace(groups, in_features=in_features)


def gptq_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: GptqConfig
) -> Iterator[tuple[str, Union[torch.Tensor, Int4Groups]]]:
    """A checkpoint's tensors with every GPTQ layer turned into `<prefix>.weight` (Int4Groups or floats).

    A layer is yielded once its qweight, qzeros and scales are read (and its g_idx, which desc_act needs); a
    g_idx read after its layer (a layer split over files) must then be input // group_size."""
    required = GPTQ_PARTS if config.desc_act else GPTQ_PARTS[:3]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in GPTQ_PARTS:
            yield name, tensor
            continue
        if prefix in done:  # a g_idx read after its layer, served as ordered groups (only without desc_act)
            _check_ordered(prefix, tensor, config)
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if all(p in parts for p in required):
            del pending[prefix]
            done.add(prefix)
            yield f"{prefix}.weight", gptq_matrix(prefix, parts, config, dequantize=prefix.endswith("lm_head"))
    if pending:
        prefix, parts = next(iter(pending.items()))
        raise ValueError(f"GPTQ layer {prefix} lacks {', '.join(p for p in required if p not in parts)}")


def _check_ordered(prefix: str, g_idx: torch.Tensor, config: GptqConfig) -> None:
    in_features = g_idx.shape[0]
    if not torch.equal(g_idx.long(), torch.arange(in_features) // (config.group_size or in_features)):
        raise ValueError(
            f"GPTQ layer {prefix}: g_idx is not input // group_size although quantization_config says desc_act false"
        )
