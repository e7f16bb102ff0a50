"""The disk KV tier's file format: one file per (model identity, rank, block hash), checksummed.

    <dir>/<identity hex>/<block hash hex>.r<rank>

    header (HEADER.size bytes, little-endian)       payload
    magic | identity | rank | block hash | length | crc32    the rank's K/V of the block, every layer it holds

The identity names the weights, dtypes, block size and layout the payload was computed with (the engine
makes it: engine/kv_tier/identity.py), so another model's files live in another folder and are never
read; the header repeats the whole key, so a file renamed or copied under the wrong name is refused too.
The CRC-32 of the payload catches a corrupt file, the length a truncated one. Pure Python: the scheduler
verifies files before it plans a restore, the runner reads them (both through `read_block_file`).
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import NamedTuple, Optional

MAGIC = b"PSKVT001"
HEADER = struct.Struct("<8s32sH32sQI")  # magic, identity, rank, block hash, payload length, crc32
HASH_BYTES = 32  # a block hash's value (SHA-256: scheduler/block_hash.py)
SUFFIX_PREFIX = ".r"  # a file's suffix: .r<rank>
TMP_SUFFIX = ".tmp"  # a file being written (renamed into place when complete)


class BlockFileKey(NamedTuple):
    """What a file holds: `rank`'s share of the block `block_hash` under the model `identity`."""

    identity: bytes  # 32 bytes
    rank: int
    block_hash: bytes  # 32 bytes


class BlockFileError(Exception):
    """A block file is missing, truncated, corrupt or holds another key."""


def block_file_path(directory: Path, key: BlockFileKey) -> Path:
    return directory / key.identity.hex() / f"{key.block_hash.hex()}{SUFFIX_PREFIX}{key.rank}"


def pack_header(key: BlockFileKey, payload: memoryview) -> bytes:
    return HEADER.pack(MAGIC, key.identity, key.rank, key.block_hash, payload.nbytes, zlib.crc32(payload))


def read_block_file(path: Path, key: BlockFileKey, out: Optional[memoryview] = None) -> int:
    """Read the file at `path` (into `out`, which must be as long as the payload, when given), checked against
    `key`, its length and its checksum; returns the payload's length. BlockFileError otherwise: the caller
    deletes the file and computes the block instead."""
    try:
        with open(path, "rb") as file:
            header = file.read(HEADER.size)
            if len(header) < HEADER.size:
                raise BlockFileError(f"{path.name}: truncated header ({len(header)} bytes)")
            magic, identity, rank, block_hash, length, crc = HEADER.unpack(header)
            if magic != MAGIC or (identity, rank, block_hash) != tuple(key):
                raise BlockFileError(f"{path.name}: holds another key (or is not a block file)")
            if out is not None and out.nbytes != length:
                raise BlockFileError(f"{path.name}: {length} payload bytes, {out.nbytes} expected")
            payload = out if out is not None else memoryview(bytearray(length))
            num_read = file.readinto(payload)
            if num_read != length or file.read(1):
                raise BlockFileError(f"{path.name}: payload of {num_read}+ bytes, header says {length}")
    except FileNotFoundError:
        raise BlockFileError(f"{path.name}: missing") from None
    except OSError as error:
        raise BlockFileError(f"{path.name}: {error}") from None
    if zlib.crc32(payload) != crc:
        raise BlockFileError(f"{path.name}: checksum mismatch")
    return length


def write_block_file(directory: Path, key: BlockFileKey, payload: memoryview) -> int:
    """Write the file atomically (a temporary file renamed into place: a reader sees all of it or nothing);
    returns the bytes written."""
    path = block_file_path(directory, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    header = pack_header(key, payload)
    with open(tmp, "wb") as file:
        file.write(header)
        file.write(payload)
    os.replace(tmp, path)
    return len(header) + payload.nbytes


def parse_file_name(name: str) -> Optional[tuple[bytes, int]]:
    """(block hash, rank) of a block file's name; None for anything else."""
    stem, sep, rank = name.rpartition(SUFFIX_PREFIX)
    if not sep or not rank.isdigit() or len(stem) != 2 * HASH_BYTES:
        return None
    try:
        return bytes.fromhex(stem), int(rank)
    except ValueError:
        return None
