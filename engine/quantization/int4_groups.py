"""Group-wise int4 weights as plain data, before a device packs them for its kernel.

    W[o, k] = (codes[o, k] - 8) * scales[o, k // G] + zeros[o, k // G]        codes in 0 .. 15

(the form of torch's int4 kernels, "tinygemm": the zero is a float offset, not a code). Quantizing a
float matrix uses each group's min and max: scale = (max - min) / 15, codes = round((w - min) / scale),
zero = min + 8 * scale, so both ends of the range are exact. AWQ's integer zero points z map to
zero = (8 - z) * scale (`from_zero_codes`).

A matrix whose in_features is not a multiple of G (SmolLM's 576 with G = 128) is padded with zero
columns up to one: `in_features` stays the logical width and the product pads the activations to
`padded_in_features` (the padded columns multiply zeros).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 32
"""`--quantization int4` with `--quantization-group-size` unset: llama.cpp's Q4 block (the perplexity table in
docs/quantization.md: groups of 64 and 128 lose far more on the embedded model)."""
CODE_OFFSET = 8


@dataclass(slots=True)
class Int4Groups:
    codes: torch.Tensor  # [out, padded_in] uint8, values 0 .. 15
    scales: torch.Tensor  # [out, padded_in // group_size] float32
    zeros: torch.Tensor  # [out, padded_in // group_size] float32 (offsets, see the module docstring)
    group_size: int
    in_features: int  # logical width (<= padded_in)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def padded_in_features(self) -> int:
        return self.codes.shape[1]

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int) -> "Int4Groups":
        """Asymmetric min/max rounding of a float [out, in] matrix, one scale and zero per group."""
        out_features, in_features = weight.shape
        padded = -(-in_features // group_size) * group_size
        w = torch.nn.functional.pad(weight.float(), (0, padded - in_features))
        groups = w.view(out_features, padded // group_size, group_size)
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
        return cls(codes.view(out_features, padded), scales, low + CODE_OFFSET * scales, group_size, in_features)

    @classmethod
    def from_zero_codes(
        cls, codes: torch.Tensor, scales: torch.Tensor, zero_codes: torch.Tensor, group_size: int
    ) -> "Int4Groups":
        """From integer zero points (AWQ, GPTQ): W = (codes - zero_codes) * scales, per group."""
        scales = scales.float()
        zeros = (CODE_OFFSET - zero_codes.float()) * scales
        return cls(
            codes.to(torch.uint8).contiguous(), scales.contiguous(), zeros.contiguous(), group_size, codes.shape[1]
        )

    @staticmethod
    def concat(parts: list["Int4Groups"]) -> "Int4Groups":
        """Stacked along out_features (fusing q|k|v, gate|up): one group size and width for all."""
        first = parts[0]
        if any(p.group_size != first.group_size or p.in_features != first.in_features for p in parts):
            raise ValueError("int4 matrices fused into one projection must share group size and in_features")
        return Int4Groups(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.zeros for p in parts]),
            first.group_size,
            first.in_features,
        )

    def take_rows(self, start: int, stop: int) -> "Int4Groups":
        """Output rows start .. stop (a column-parallel shard): each row keeps its own groups."""
        return Int4Groups(
            self.codes[start:stop].contiguous(),
            self.scales[start:stop].contiguous(),
            self.zeros[start:stop].contiguous(),
            self.group_size,
            self.in_features,
        )

    def take_columns(self, start: int, stop: int) -> "Int4Groups":
        """Input columns start .. stop (a row-parallel shard), cut at group boundaries: a group's one scale and zero
        cannot be cut between ranks (ValueError otherwise). The last group's padding goes with the matrix's end."""
        group = self.group_size
        if start % group or (stop % group and stop != self.in_features) or not 0 <= start < stop <= self.in_features:
            raise ValueError(f"columns {start} .. {stop} cut a {group}-input group of {self.in_features} inputs")
        padded_stop = self.padded_in_features if stop == self.in_features else stop
        groups = slice(start // group, padded_stop // group)
        return Int4Groups(
            self.codes[:, start:padded_stop].contiguous(),
            self.scales[:, groups].contiguous(),
            self.zeros[:, groups].contiguous(),
            group,
            stop - start,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in_features] float."""
        out_features, padded = self.codes.shape
        groups = self.codes.view(out_features, -1, self.group_size).float() - CODE_OFFSET
        w = groups * self.scales[..., None] + self.zeros[..., None]
        return w.view(out_features, padded)[:, : self.in_features].to(dtype)

    def nibbles(self) -> torch.Tensor:
        """[out, padded_in / 2] uint8: column 2j in the high nibble, 2j + 1 in the low one (the layout
        CUDA's `_convert_weight_to_int4pack` takes)."""
        return (self.codes[:, ::2] << 4) | self.codes[:, 1::2]

    def scales_and_zeros(self) -> torch.Tensor:
        """[groups, out, 2] float32: the kernels' qScaleAndZeros."""
        return torch.stack([self.scales.t(), self.zeros.t()], dim=-1).contiguous()
