"""Whether torch's bf16 products run on AMX tiles here: oneDNN takes the tile unit on CPUs that have it
(Sapphire Rapids and newer), and there its large bf16 products outrun every vdpbf16ps kernel of ours."""

from __future__ import annotations

import torch


def torch_bf16_products_use_amx() -> bool:
    """Whether this CPU has AMX tiles, which oneDNN's bf16 products run on (Sapphire Rapids and newer)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private in torch 2.x
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False
