"""Content hashes of full KV blocks, chained so that a hash names a whole prefix."""

from __future__ import annotations

import hashlib
from array import array
from typing import NamedTuple, Optional, Sequence


class BlockHash(NamedTuple):
    """`value` digests the parent block's value and `token_ids`; equal values mean
    equal prefixes (SHA-256, so a client cannot forge a collision to read another
    request's cache). `token_ids` is kept to check a hit exactly."""

    value: bytes
    token_ids: tuple[int, ...]


MediaSpan = tuple[int, int, bytes]
"""(start, end, key): a span of prompt positions whose K/V depend on more than their token ids (an image's
placeholder tokens), and the key of what they stand for (the image's content hash)."""


def hash_block(parent: Optional[BlockHash], token_ids: Sequence[int], keys: Sequence[bytes] = ()) -> BlockHash:
    """`keys`: the media the block's positions stand for (their content hashes), so that the same placeholder
    tokens for another image hash apart."""
    tokens = tuple(token_ids)
    digest = hashlib.sha256(parent.value if parent is not None else b"")
    digest.update(array("q", tokens).tobytes())
    for key in keys:  # (length-prefixed: keys cannot pass for other keys)
        digest.update(b"media" + len(key).to_bytes(4, "little") + key)
    return BlockHash(digest.digest(), tokens)


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    seed: Optional[bytes] = None,
    spans: Sequence[MediaSpan] = (),
) -> None:
    """Append the hashes of the full blocks of `token_ids` not yet in `block_hashes`.

    block i covers token_ids[i * block_size : (i + 1) * block_size]; `seed` (a LoRA mix's key) stands as the
    first block's parent, so the same tokens under another seed hash apart; each block a media span overlaps
    also digests that span's key (and, chained, every block after it).
    """
    num_full = len(token_ids) // block_size
    root = None if seed is None else BlockHash(seed, ())
    parent = block_hashes[-1] if block_hashes else root
    for i in range(len(block_hashes), num_full):
        start, end = i * block_size, (i + 1) * block_size
        keys = [key for first, last, key in spans if first < end and last > start] if spans else ()
        parent = hash_block(parent, token_ids[start:end], keys)
        block_hashes.append(parent)
