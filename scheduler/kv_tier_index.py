"""Which blocks the disk KV tier holds: a set of block hashes over a directory, bounded in bytes (LRU).

The scheduler asks it, on a prefix-cache miss, for the longest run of a request's next blocks that the tier
holds (`verified_run`: each file read and checked once, a bad one deleted and the run cut there; later asks
compare the files' stat with what was read, so a request waiting for pool blocks does not re-read its files
every step), and tells it which blocks a step fills (`plan_saves`: those it does not hold yet, which the
runner then writes). It is the only one that deletes files: the size bound evicts the least recently used
blocks. A block is used when a step restores it and when a request that holds it ends, prefix-cache hits in
the pool included (`touch`, tail first, so a prompt's later blocks leave before its first ones, without which
the rest are of no use: a restore stops at the first block missing). The order is kept in memory and written
into the files' mtimes at `close` (a restart scans them; after a crash the write times stand in). Every rank
of a tensor-parallel or pipeline-parallel engine writes its own file of a block; a block counts as held when
every rank's file is there.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from scheduler.kv_tier_file import (
    TMP_SUFFIX,
    BlockFileError,
    BlockFileKey,
    block_file_path,
    parse_file_name,
    read_block_file,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVTierStats:
    """Cumulative counts of one tier (metrics)."""

    tier: str
    hit_blocks: int = 0
    hit_tokens: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    corrupt_files: int = 0  # detected (checksum, length, key) and deleted

    def snapshot(self) -> "KVTierStats":
        return KVTierStats(
            self.tier, self.hit_blocks, self.hit_tokens, self.read_bytes, self.written_bytes, self.corrupt_files
        )


class KVTierIndex:
    """The blocks of one model identity in `directory`, and the LRU order of every block file there (other
    identities' files count towards `max_bytes` and are evicted like ours, never read).

    `file_bytes` is what one block's files take over all ranks (headers included): the size a planned save
    is accounted at before the runner has written it. Build it with `open`, which scans the directory.
    """

    def __init__(self, directory: Path, identity: bytes, num_ranks: int, max_bytes: int, file_bytes: int):
        self.directory = directory
        self.identity = identity
        self.num_ranks = num_ranks
        self.max_bytes = max_bytes
        self.file_bytes = file_bytes
        self.stats = KVTierStats("disk")
        # (identity hex, block hash) -> bytes of its files, least recently used first
        self._lru: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._held: set[bytes] = set()  # block hashes of our identity with every rank's file
        self._unconfirmed: set[bytes] = set()  # planned saves not yet read back (the writer may still be at them)
        # blocks read back whole -> each rank file's (inode, size, mtime, ctime) then: unchanged, not read again
        self._verified: dict[bytes, list[tuple[int, int, int, int]]] = {}
        self._foreign_ranks: dict[tuple[str, bytes], tuple[int, ...]] = {}  # other identities' blocks: their ranks
        self._total_bytes = 0

    @classmethod
    def open(cls, directory: Path, identity: bytes, num_ranks: int, max_bytes: int, file_bytes: int) -> "KVTierIndex":
        """The index over what `directory` holds (made if missing); evicts down to `max_bytes` at once."""
        index = cls(directory, identity, num_ranks, max_bytes, file_bytes)
        directory.mkdir(parents=True, exist_ok=True)
        index._scan()
        index._evict(protect=())
        logger.info(
            "KV disk tier %s: %d blocks of this model, %.1f of %.1f MiB used",
            directory,
            len(index._held),
            index._total_bytes / 2**20,
            max_bytes / 2**20,
        )
        return index

    @property
    def num_blocks(self) -> int:
        return len(self._held)

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._held

    def verified_run(self, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes`, from the first, the tier holds in files that read back whole and
        unaltered (read once; after that, while their stat is unchanged, not read again). A bad file ends the
        run: its block's files are deleted (the block is computed instead); a missing one ends it too."""
        identity_hex = self.identity.hex()
        for n, block_hash in enumerate(block_hashes):
            if block_hash not in self._held:
                return n
            paths = [
                block_file_path(self.directory, BlockFileKey(self.identity, rank, block_hash))
                for rank in range(self.num_ranks)
            ]
            seen = self._verified.get(block_hash)
            if seen is not None:
                if seen == _stats(paths):
                    continue
                del self._verified[block_hash]  # changed or gone since it was read: read it again
            num_bytes = 0
            try:
                for rank, path in enumerate(paths):
                    if block_hash in self._unconfirmed and not path.exists():
                        return n  # not written yet (or the write failed): a miss, nothing wrong with the tier
                    num_bytes += read_block_file(path, BlockFileKey(self.identity, rank, block_hash))
            except BlockFileError as error:
                logger.warning("KV disk tier: %s; the block is computed instead", error)
                self.stats.corrupt_files += 1
                self._drop((identity_hex, block_hash))
                return n
            self.stats.read_bytes += num_bytes
            self._unconfirmed.discard(block_hash)
            self._verified[block_hash] = _stats(paths)
        return len(block_hashes)

    def forget(self, block_hashes: Iterable[bytes]) -> None:
        """Blocks whose files did not read back at a restore: deleted (what is left of them) and no longer held."""
        identity_hex = self.identity.hex()
        for block_hash in block_hashes:
            self.stats.corrupt_files += 1
            self._drop((identity_hex, block_hash))

    def touch(self, block_hashes: Sequence[bytes]) -> None:
        """Mark the held ones of `block_hashes` used now, the last of them most recently."""
        identity_hex = self.identity.hex()
        for block_hash in block_hashes:
            if block_hash in self._held:
                self._lru.move_to_end((identity_hex, block_hash))

    def close(self) -> None:
        """Write the use order into the files' mtimes for the next start: the most recently used first, each
        older by a microsecond (a close cut short leaves the least used with their older write times)."""
        now = time.time_ns()
        for age, key in enumerate(reversed(self._lru)):
            stamp = now - age * 1000
            for path in self._files(key):
                try:
                    os.utime(path, ns=(stamp, stamp))
                except OSError:
                    pass  # (gone meanwhile: the next start does not find it)

    def unplan(self, block_hashes: Iterable[bytes]) -> None:
        """Planned saves whose step never ran (it failed): never written, so not held."""
        identity_hex = self.identity.hex()
        for block_hash in block_hashes:
            if block_hash in self._unconfirmed:
                self._total_bytes -= self._lru.pop((identity_hex, block_hash), 0)
                self._held.discard(block_hash)
                self._unconfirmed.discard(block_hash)
                self.stats.written_bytes -= self.file_bytes

    def plan_saves(self, block_hashes: Sequence[bytes], keep: Sequence[bytes] = ()) -> list[bytes]:
        """The blocks among `block_hashes` to write (those not held), now counted as held; evicts the least
        recently used others, but never `keep` (the step's restores, which the runner has yet to read), to stay
        within `max_bytes`; where the step's own blocks do not fit even so, its last ones are not saved (a
        prompt's head is what a restore can use). A block larger than the bound is never saved.

        (A block evicted while the writer thread is still at its file gets written after all: a file outside
        the index, which the next start-up's scan counts and evicts in its turn.)"""
        if self.file_bytes > self.max_bytes:
            return []
        identity_hex = self.identity.hex()
        planned = [h for h in dict.fromkeys(block_hashes) if h not in self._held]
        self._unconfirmed.update(planned)
        for block_hash in reversed(planned):  # a prompt's later blocks older: evicted before its first ones
            self._held.add(block_hash)
            self._lru[(identity_hex, block_hash)] = self.file_bytes
            self._total_bytes += self.file_bytes
            self.stats.written_bytes += self.file_bytes
        if self._total_bytes > self.max_bytes:
            self._evict(protect={(identity_hex, h) for h in (*planned, *keep)})
        while self._total_bytes > self.max_bytes and planned:  # the step's own blocks do not fit: its last unsaved
            block_hash = planned.pop()
            self._total_bytes -= self._lru.pop((identity_hex, block_hash))
            self._held.discard(block_hash)
            self._unconfirmed.discard(block_hash)
            self.stats.written_bytes -= self.file_bytes
        return planned

    def _scan(self) -> None:
        """Every block file below the directory, oldest use first; leftover temporary files are deleted."""
        found: dict[tuple[str, bytes], list[tuple[int, int]]] = {}  # -> (rank, mtime in ns) per file
        sizes: dict[tuple[str, bytes], int] = {}
        for folder in self.directory.iterdir():
            if not folder.is_dir():
                continue
            for entry in os.scandir(folder):
                if entry.name.endswith(TMP_SUFFIX):
                    _unlink(Path(entry.path))  # a write cut short (a crash): never renamed into place
                    continue
                parsed = parse_file_name(entry.name)
                if parsed is None or not entry.is_file():
                    continue
                info = entry.stat()
                key = (folder.name, parsed[0])
                found.setdefault(key, []).append((parsed[1], info.st_mtime_ns))
                sizes[key] = sizes.get(key, 0) + info.st_size
        own = self.identity.hex()
        for key in sorted(found, key=lambda k: max(mtime for _, mtime in found[k])):
            self._lru[key] = sizes[key]
            self._total_bytes += sizes[key]
            if key[0] != own:
                self._foreign_ranks[key] = tuple(rank for rank, _ in found[key])
            elif {rank for rank, _ in found[key]} >= set(range(self.num_ranks)):
                self._held.add(key[1])

    def _evict(self, protect: set[tuple[str, bytes]] | tuple[()]) -> None:
        for key in list(self._lru):
            if self._total_bytes <= self.max_bytes:
                return
            if key not in protect:
                self._drop(key)

    def _drop(self, key: tuple[str, bytes]) -> None:
        self._total_bytes -= self._lru.pop(key, 0)
        if key[0] == self.identity.hex():
            self._held.discard(key[1])
            self._unconfirmed.discard(key[1])
            self._verified.pop(key[1], None)
        for path in self._files(key):
            _unlink(path)
        self._foreign_ranks.pop(key, None)

    def _files(self, key: tuple[str, bytes]) -> list[Path]:
        """Every rank's file of a block: ours by name, another identity's as the start-up scan found them (a
        glob per block would list the whole folder each time)."""
        identity = bytes.fromhex(key[0])
        ranks = range(self.num_ranks) if key[0] == self.identity.hex() else self._foreign_ranks.get(key, ())
        return [block_file_path(self.directory, BlockFileKey(identity, rank, key[1])) for rank in ranks]


def _stats(paths: list[Path]) -> list[tuple[int, int, int, int]]:
    """Each file's (inode, size, mtime, ctime: no write leaves all four as they were); (0, -1, 0, 0) for one
    that is gone."""
    out = []
    for path in paths:
        try:
            info = path.stat()
        except OSError:
            out.append((0, -1, 0, 0))
            continue
        out.append((info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
    return out


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
