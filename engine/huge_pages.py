"""2 MB pages for the large CPU tensors every decode step streams through: the KV cache and the weights.

A decode step at a long context reads each layer's K/V and weights once, scattered over tens of thousands of
4 KB pages; with transparent huge pages in the kernel's `madvise` mode (the default of most distributions) none
of that memory gets 2 MB pages unless asked. So the KV cache is advised before it is first written (its pages
fault in whole), and the loaded weights, already written, are collapsed in place (MADV_COLLAPSE, Linux 6.1+; an
older kernel refuses it and khugepaged backs the advised ranges later, in the background). Only whole 2 MB pages
inside a tensor's own storage are advised: memory of another allocation is never touched. Nowhere else than
Linux, with THP set to `never`, or for a tensor under 2 MB: nothing is done. docs/performance.md has the
measurement.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import types
from pathlib import Path
from typing import Iterable, Optional

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
WALK_DEPTH = 6
"""How deep `large_tensors` follows attributes and containers from the object it starts at."""


def huge_pages_available(setting: Path = THP_SETTING) -> bool:
    """Whether this kernel gives transparent huge pages to memory that asks for them (`[always]` or
    `[madvise]` selected)."""
    if platform.system() != "Linux":
        return False
    try:
        selected = setting.read_text()
    except OSError:
        return False
    return "[always]" in selected or "[madvise]" in selected


def advise_huge_pages(tensors: Iterable[torch.Tensor], *, collapse: bool, setting: Path = THP_SETTING) -> int:
    """Ask for 2 MB pages under the whole huge pages inside each CPU tensor's storage (each storage once);
    `collapse`: also back what is already written now. Returns the bytes advised (0 where nothing applies)."""
    if not huge_pages_available(setting):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    advised = 0
    seen: set[int] = set()
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        span = _storage_span(tensor)
        if span is None or span[0] in seen:
            continue
        start, size = span
        seen.add(start)
        first = -(-start // HUGE_PAGE) * HUGE_PAGE
        length = (start + size) // HUGE_PAGE * HUGE_PAGE - first
        if length <= 0 or madvise(first, length, MADV_HUGEPAGE) != 0:
            continue
        if collapse:
            madvise(first, length, MADV_COLLAPSE)  # refused on kernels before 6.1: khugepaged backs it later
        advised += length
    return advised


def _storage_span(tensor: torch.Tensor) -> Optional[tuple[int, int]]:
    """(address, bytes) of the memory under `tensor`; None for a tensor without storage of its own (an opaque
    layout such as oneDNN's packed weights, or a meta tensor)."""
    try:
        storage = tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None
    return (storage.data_ptr(), storage.nbytes()) if storage.data_ptr() else None


def large_tensors(root: object, min_bytes: int = HUGE_PAGE) -> list[torch.Tensor]:
    """The tensors of at least `min_bytes` reachable from `root` through attributes, slots, lists, tuples and
    dicts (a model's weights, whatever classes hold them: plain, packed, quantized), each storage once."""
    found: dict[int, torch.Tensor] = {}
    visited: set[int] = set()

    def walk(node: object, depth: int) -> None:
        if id(node) in visited or depth > WALK_DEPTH:
            return
        visited.add(id(node))
        if isinstance(node, torch.Tensor):
            span = _storage_span(node)
            if span is not None and span[1] >= min_bytes:
                found.setdefault(span[0], node)
            return
        if node is None or isinstance(
            node, (str, bytes, int, float, type, types.ModuleType, torch.dtype, torch.device)
        ):
            return  # leaves, and modules (a module's globals are not the model's)
        if isinstance(node, (list, tuple, set, frozenset)):
            children: Iterable[object] = node
        elif isinstance(node, dict):
            children = node.values()
        else:
            fields = getattr(node, "__dict__", {})
            slots = [name for cls in type(node).__mro__ for name in getattr(cls, "__slots__", ())]
            children = [*fields.values(), *(getattr(node, name) for name in slots if hasattr(node, name))]
        for child in children:
            walk(child, depth + 1)

    walk(root, 0)
    return list(found.values())


def back_weights_with_huge_pages(model: object) -> None:
    """Collapse the loaded weights of `model` into 2 MB pages (see the module docstring), and log how much."""
    advised = advise_huge_pages(large_tensors(model), collapse=True)
    if advised:
        logger.info("weights: %.0f MiB advised to 2 MB pages", advised / 2**20)
