"""Reading a GGUF file's header: gguf-py's reader, made quicker, and shared while a conversion reads one file.

gguf-py's `GGUFReader` parses every metadata value into numpy views of the memory-mapped file. A tokenizer's
vocabulary and merges are about 100,000 strings of two views each, and each view of an `np.memmap` runs memmap's
Python-level `__getitem__` and `__array_finalize__`: most of a parse. `read_gguf` takes the same views from a
plain ndarray over the same map (same fields, parts and tensors, still mapped, not copied).

A conversion through transformers (gguf_converter.py) opens the file once for its config, once for the weights
and once for the tokenizer, and looks up gguf-py's tensor-name table once per module of the model, a few
milliseconds each time. `shared_readers()` makes each of those happen once while it is active.
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import gguf
import numpy as np


class PlainViewReader(gguf.GGUFReader):
    """`gguf.GGUFReader` whose field parts and tensor data are views of a plain ndarray over the map."""

    _plain: Optional[np.ndarray] = None

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Optional[str] = None) -> np.ndarray:
        # the base class's own `_get`, but slicing a plain view of `self.data` (set first thing in its __init__)
        plain = self._plain
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        dtype = np.dtype(dtype)
        count = int(count)
        array = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
        return array.view(array.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


class ArraysLeftOutReader(PlainViewReader):
    """`PlainViewReader` without the fields whose value is an array (a tokenizer's vocabulary, merges, scores and
    token types): they are stepped over, not parsed, for a reader that wants the tensors and a few scalars."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        if raw_type != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        try:
            end = self._value_end(orig_offs, raw_type)
        except struct.error as exc:  # past the end of the file
            raise ValueError(f"truncated GGUF header: an array at byte {orig_offs} ends past the file") from exc
        return end - orig_offs, [], [], [gguf.GGUFValueType.ARRAY]

    def _push_field(self, field: gguf.ReaderField, skip_sum: bool = False) -> int:
        if field.types[:1] == [gguf.GGUFValueType.ARRAY]:
            return 0  # left out (its size was counted by _value_end)
        return super()._push_field(field, skip_sum)

    def _value_end(self, offset: int, raw_type: int) -> int:
        """Where the value of type `raw_type` at `offset` ends."""
        order = "<" if (sys.byteorder == "little") == (self.byte_order != "S") else ">"
        if raw_type == gguf.GGUFValueType.STRING:
            (length,) = struct.unpack_from(order + "Q", self.data.data, offset)
            return offset + 8 + length
        scalar = self.gguf_scalar_to_np.get(gguf.GGUFValueType(raw_type))
        if scalar is not None:
            return offset + np.dtype(scalar).itemsize
        if raw_type != gguf.GGUFValueType.ARRAY:
            raise ValueError(f"Unknown/unhandled field type {raw_type}")
        item_type, count = struct.unpack_from(order + "IQ", self.data.data, offset)
        offset += 12
        scalar = self.gguf_scalar_to_np.get(gguf.GGUFValueType(item_type))
        if scalar is not None:
            return offset + count * np.dtype(scalar).itemsize
        for _ in range(count):
            offset = self._value_end(offset, item_type)
        return offset


def read_gguf(path: Union[str, os.PathLike], *, arrays: bool = True) -> gguf.GGUFReader:
    """The GGUF at `path`, its header parsed (tensors memory-mapped, read only); `arrays=False`: without the
    fields whose value is an array (`ArraysLeftOutReader`). Inside `shared_readers()`, the reader transformers
    gets, with every field."""
    factory: Any = gguf.GGUFReader
    if getattr(factory, "shares_readers", False):
        return factory(path)
    return (PlainViewReader if arrays else ArraysLeftOutReader)(os.fspath(path))


@contextlib.contextmanager
def shared_readers() -> Iterator[None]:
    """While active, `gguf.GGUFReader(path)` (as transformers calls it) gives one read-only reader per file, and
    `gguf.get_tensor_name_map` one table per architecture and layer count. Both are only read by their users.

    It changes the `gguf` module for the whole process, so it is for a process doing one thing at a time: the
    conversion's child process (no other thread reads GGUF files there, and transformers imports the names
    when it calls them, so none outlives the context)."""
    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, gguf.GGUFReader] = {}

    def shared(path: Union[str, os.PathLike], mode: str = "r") -> gguf.GGUFReader:
        if mode != "r":  # writable or copy-on-write: a reader of its own
            return PlainViewReader(os.fspath(path), mode)  # type: ignore[arg-type]  # gguf's Literal modes
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = PlainViewReader(os.fspath(path))
        return readers[key]

    shared.shares_readers = True  # type: ignore[attr-defined]
    gguf.GGUFReader = shared  # type: ignore[assignment,misc]  # a factory in the class's place, for its callers
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader = original_reader  # type: ignore[misc]  # the class back in its place
        gguf.get_tensor_name_map = original_name_map
