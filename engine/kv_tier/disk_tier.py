"""The runner's side of the disk KV tier: copy a step's filled blocks out after its forward, read restored ones
in before it. Which blocks, the step message says (scheduler/output.py); this rank's files are its own."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from engine.attention.kv_cache import KVCache
from engine.kv_tier.block_copy import gather_blocks, payload_bytes, scatter_blocks
from engine.kv_tier.block_writer import BlockWriter
from scheduler.kv_tier_file import BlockFileError, BlockFileKey, block_file_path, read_block_file


class KVTierReadError(RuntimeError):
    """Block files the scheduler had verified no longer read back (deleted or altered in the moment since, by
    another process): the blocks that did read are in the cache; `block_hashes` are those that did not, never
    attended to (Engine._lost_restores: the step is scheduled again, their requests compute those blocks)."""

    def __init__(self, message: str, block_hashes: Sequence[bytes]):
        super().__init__(message)
        self.block_hashes = tuple(block_hashes)


class DiskTier:
    """Block files of `identity` in `directory`, for rank `rank`."""

    def __init__(self, directory: Path, identity: bytes, rank: int):
        self.directory = directory
        self.identity = identity
        self.rank = rank
        self.writer = BlockWriter(directory)

    def restore(self, kv_cache: KVCache, restores: Sequence[tuple[bytes, int]]) -> None:
        """Read the blocks `(hash, block id)` into the cache (before the step's forward reads them)."""
        payloads = np.empty((len(restores), payload_bytes(kv_cache)), dtype=np.uint8)
        errors: list[tuple[bytes, str]] = []
        for row, (block_hash, _) in zip(payloads, restores):
            key = BlockFileKey(self.identity, self.rank, block_hash)
            try:
                read_block_file(block_file_path(self.directory, key), key, memoryview(row.data))
            except BlockFileError as error:
                errors.append((block_hash, str(error)))
        if not errors:
            scatter_blocks(kv_cache, [block_id for _, block_id in restores], payloads)
            return
        bad = {block_hash for block_hash, _ in errors}
        good = [i for i, (block_hash, _) in enumerate(restores) if block_hash not in bad]
        if good:
            scatter_blocks(kv_cache, [restores[i][1] for i in good], payloads[good])
        raise KVTierReadError(f"KV disk tier: {errors[0][1]}", [block_hash for block_hash, _ in errors])

    def save(self, kv_cache: KVCache, saves: Sequence[tuple[int, bytes]]) -> None:
        """Copy the blocks `(block id, hash)` out of the cache now (the step's forward has filled them; a later
        step may overwrite them) and queue their files."""
        payloads = gather_blocks(kv_cache, [block_id for block_id, _ in saves])
        ready = None
        if payloads.device.type == "cuda":
            host = torch.empty(payloads.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(payloads, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            payloads = host
        keys = [BlockFileKey(self.identity, self.rank, block_hash) for _, block_hash in saves]
        self.writer.put(keys, payloads, ready)

    def close(self) -> None:
        """Write every queued block (the engine is shutting down: the next one starts from these files)."""
        self.writer.close()
