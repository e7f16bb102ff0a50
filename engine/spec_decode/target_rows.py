"""The target's whole embedding and LM head for a draft head on one rank, where tensor parallelism gives each rank
a slice of them (an EAGLE head and a prediction layer read them: engine/spec_decode/eagle_model.py, mtp.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.errors import SettingsConflictError
from engine.loading.loader import CheckpointError, iter_weights


def full_target_rows(checkpoint: Path, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The target checkpoint's whole embedding and LM head (the embedding again where they are tied), for a head
    beside a target whose ranks each hold a slice of them; SettingsConflictError where they are not stored so."""
    names = {"model.embed_tokens.weight": "embed", "embed_tokens.weight": "embed", "lm_head.weight": "lm_head"}
    rows: dict[str, torch.Tensor] = {}
    try:
        for name, tensor in iter_weights(checkpoint, keep=lambda n: n in names):
            rows[names[name]] = tensor.to(dtype=dtype, device=device)
    except CheckpointError as error:
        raise SettingsConflictError(f"the draft head reads the target's embedding: {error}") from error
    if "embed" not in rows:
        raise SettingsConflictError(
            "the draft head reads the target's whole embedding beside tensor parallelism, and the target's "
            "checkpoint stores none as model.embed_tokens.weight (GGUF and vision-language targets: one process)"
        )
    return rows["embed"], rows.get("lm_head", rows["embed"])
