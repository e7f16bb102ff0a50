"""2 MB pages for the large CPU tensors every decode step streams through: the KV cache and the weights.

A decode step at a long context reads each layer's K/V and weights once, scattered over tens of thousands of
4 KB pages; with transparent huge pages in the kernel's `madvise` mode (the default of most distributions) none
of that memory gets 2 MB pages unless asked. So the KV cache is advised before it is first written (its pages
fault in whole), and the loaded weights, already written, are collapsed in place (MADV_COLLAPSE, Linux 6.1+; an
older kernel refuses it and khugepaged backs the advised ranges later, in the background). Only whole 2 MB pages
inside a tensor's own storage are advised: memory of another allocation is never touched. No 2 MB page fits
inside a matrix under 2 MB, so those (a small model's are all that small) are first copied, in the order a step
reads them, into one arena of their own (`pack_small_weights`): a step's matrices become one stream, on 2 MB
pages. Nowhere else than Linux, or with THP set to `never`, is anything advised (the small matrices are still
packed). docs/performance.md has the measurements.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import types
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
WALK_DEPTH = 6
"""How deep `reachable_tensors` follows attributes and containers from the object it starts at."""
ARENA_ALIGN = 64
"""Each storage packed by `pack_small_weights` starts on a cache line."""


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
    madvise = _madvise()
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
    """The tensors of at least `min_bytes` reachable from `root` (`reachable_tensors`), each storage once."""
    found: dict[int, torch.Tensor] = {}
    for tensor in reachable_tensors(root):
        span = _storage_span(tensor)
        if span is not None and span[1] >= min_bytes:
            found.setdefault(span[0], tensor)
    return list(found.values())


def reachable_tensors(root: object) -> list[torch.Tensor]:
    """Every tensor object reachable from `root` through attributes, slots, lists, tuples and dicts (a model's
    weights, whatever classes hold them: plain, packed, quantized), in the order met, each object once. (A loop
    over a stack, not a recursive closure: that would be a reference cycle holding what it found until the
    cyclic GC ran, and an engine's memory must go when its last reference does.)"""
    found: list[torch.Tensor] = []
    visited: set[int] = set()
    stack: list[tuple[object, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if id(node) in visited or depth > WALK_DEPTH:
            continue
        visited.add(id(node))
        if isinstance(node, torch.Tensor):
            found.append(node)
            continue
        if node is None or isinstance(
            node, (str, bytes, int, float, type, types.ModuleType, torch.dtype, torch.device)
        ):
            continue  # leaves, and modules (a module's globals are not the model's)
        if isinstance(node, (list, tuple, set, frozenset)):
            children: list[object] = list(node)
        elif isinstance(node, dict):
            children = list(node.values())
        else:
            fields = getattr(node, "__dict__", {})
            slots = [name for cls in type(node).__mro__ for name in getattr(cls, "__slots__", ())]
            children = [*fields.values(), *(getattr(node, name) for name in slots if hasattr(node, name))]
        stack.extend((child, depth + 1) for child in reversed(children))  # popped in their own order
    return found


def pack_small_weights(weights: Sequence[object], *, also: object = None, setting: Path = THP_SETTING) -> int:
    """Copy the storages under 2 MB of `weights` (the matrices a step reads, in the order it reads them), in
    that order, into one arena (advised to 2 MB pages where the kernel gives them), and point every tensor
    on them at its copy (`set_`: the same tensor objects, so whatever holds them sees the move); the tensors
    reachable from `also` (the whole model: a stacked view of the experts, a tied head's shard) on those
    storages too. Returns the bytes packed (0 where nothing applies).

    No 2 MB page fits inside a storage under 2 MB, so a small model's matrices (SmolLM2-135M's are all under
    2 MB) were read on 4 KB pages from wherever the allocator put them; packed, a step's matrices are one
    stream on 2 MB pages. Only the bytes the tensors use are copied (a shard's rows, not its whole source).
    Run it once the weights are loaded and before anything keeps their addresses (a fused step's table). A
    view neither `weights` nor `also` reaches would keep the old copy; weights are not written after loading,
    so it would still read the same values."""
    groups: dict[int, _Moved] = {}  # by the storage's own identity: two storages may share an address
    met: set[int] = set()  # tensor objects, each moved once (a tied matrix is met twice)

    def gather(root: object, open_new: bool) -> None:
        for tensor in reachable_tensors(root):
            if id(tensor) in met or tensor.device.type != "cpu":
                continue
            met.add(id(tensor))
            if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
                continue  # a subclass (a quantized or fake tensor) or an opaque layout
            try:
                storage = tensor.untyped_storage()
            except (NotImplementedError, RuntimeError):
                continue
            key = storage._cdata
            if key in groups:
                groups[key].tensors.append(tensor)
            elif open_new and storage.data_ptr() and 0 < storage.nbytes() < HUGE_PAGE and tensor.numel():
                groups[key] = _Moved(storage, [tensor])

    for weight in weights:
        gather(weight, open_new=True)
    if also is not None:
        gather(also, open_new=False)
    spans = [group.span() for group in groups.values()]
    slots = [-(-(end - begin) // ARENA_ALIGN) * ARENA_ALIGN for begin, end in spans]
    total = sum(slots)
    if total < HUGE_PAGE:
        return 0  # under one 2 MB page in all: nothing to gain
    pages = -(-total // HUGE_PAGE) * HUGE_PAGE
    arena = torch.empty(pages + HUGE_PAGE, dtype=torch.uint8)  # room to start on a 2 MB boundary
    start = -(-arena.data_ptr() // HUGE_PAGE) * HUGE_PAGE - arena.data_ptr()
    if huge_pages_available(setting):  # advised before the copies write it: its pages fault in whole
        _madvise()(arena.data_ptr() + start, pages, MADV_HUGEPAGE)
    offset = start
    with torch.inference_mode():  # weights loaded under inference mode take set_ only inside it
        for group, (begin, end), slot in zip(groups.values(), spans, slots):
            source = torch.empty(0, dtype=torch.uint8).set_(group.storage)
            arena[offset : offset + end - begin].copy_(source[begin:end])
            for tensor in group.tensors:
                size = tensor.element_size()  # divides `begin` (a multiple of ARENA_ALIGN) and `offset`
                tensor.set_(
                    arena.untyped_storage(),
                    (offset + tensor.storage_offset() * size - begin) // size,
                    tensor.size(),
                    tensor.stride(),
                )
            offset += slot
    return total


class _Moved:
    """A storage `pack_small_weights` moves, and the tensors on it."""

    __slots__ = ("storage", "tensors")

    def __init__(self, storage: torch.UntypedStorage, tensors: list[torch.Tensor]):
        self.storage = storage
        self.tensors = tensors

    def span(self) -> tuple[int, int]:
        """The bytes [begin, end) of the storage its tensors use, `begin` rounded down to ARENA_ALIGN."""
        begin, end = self.storage.nbytes(), 0
        for tensor in self.tensors:
            if tensor.numel() == 0:
                continue
            size, first = tensor.element_size(), int(tensor.storage_offset())
            extent = 1 + sum((n - 1) * abs(step) for n, step in zip(tensor.shape, tensor.stride()))
            begin = min(begin, first * size)
            end = max(end, (first + extent) * size)
        begin = min(begin, end) // ARENA_ALIGN * ARENA_ALIGN
        return begin, end


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _return_freed_memory() -> None:
    """glibc keeps the freed small copies in its heap; give those pages back (elsewhere: nothing)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def back_weights_with_huge_pages(model: object) -> None:
    """Pack the small matrices of `model` (`pack_small_weights`, in the order of its `weight_tensors()`), then
    collapse its loaded weights into 2 MB pages (see the module docstring), and log how much."""
    weight_tensors = getattr(model, "weight_tensors", None)
    packed = pack_small_weights(weight_tensors(), also=model) if weight_tensors is not None else 0
    if packed:
        _return_freed_memory()  # the old copies, freed as the packing returned
        logger.info("weights: %.0f MiB of matrices under 2 MB packed together", packed / 2**20)
    advised = advise_huge_pages(large_tensors(model), collapse=True)
    if advised:
        logger.info("weights: %.0f MiB advised to 2 MB pages", advised / 2**20)
