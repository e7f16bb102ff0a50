"""What a block file's K/V depends on, as 32 bytes: a different model, dtype or layout never reads them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from engine.attention.kv_cache import KVCacheSpec

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def weights_fingerprint(checkpoint_dir: Path, gguf: Optional[Path]) -> dict[str, list[tuple[str, int, int]]]:
    """Name, size and mtime (ns) of every weight file and config.json: cheap to take (no weight is read)
    and changed by any re-download, conversion or edit."""

    def stat(path: Path) -> tuple[str, int, int]:
        info = path.stat()
        return (path.name, info.st_size, info.st_mtime_ns)

    files = sorted(p for p in checkpoint_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json")
    return {"checkpoint": [stat(p) for p in files], "gguf": [stat(gguf)] if gguf is not None else []}


def model_identity(
    checkpoint_dir: Path,
    gguf: Optional[Path],
    spec: KVCacheSpec,
    *,
    num_layers: int,
    dtype: str,
    quantization: str,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
) -> bytes:
    """SHA-256 over the weights' fingerprint (config.json included), the compute dtype and quantization, the KV
    cache's layout (dtype, block size, head size, the model's `num_layers`) and the parallel split (which decides
    what each rank's file holds): the same on every rank of one engine.
    The block's own hash (its tokens, its prefix, its adapters) completes a file's key."""
    described = {
        "weights": weights_fingerprint(checkpoint_dir, gguf),
        "dtype": dtype,
        "quantization": quantization,
        # (what every rank's spec shares: a rank's own layers and heads follow from the split and config.json)
        "kv": [str(spec.dtype), spec.block_size, spec.head_dim, spec.latent_rank, num_layers],
        "split": [tensor_parallel_size, pipeline_parallel_size],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).digest()
