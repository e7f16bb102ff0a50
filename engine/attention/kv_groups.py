"""Which layers share a block table: the KV cache's layer groups, from each layer's sliding window or chunk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True, slots=True)
class KVGroups:
    """The layers of each group, the group's sliding window (None: none) and its attention chunk (None: none);
    neither: full attention.

    Layers that attend alike share a block table. A model that mixes sliding-window and full layers (Gemma
    2/3, GPT-OSS) gets a group per kind, so that the sliding layers' blocks behind the window are freed while
    the full layers keep theirs (scheduler/kv_cache_manager.py); so does one that mixes chunked local attention
    and full layers (Llama 4), whose chunked layers free the blocks before the current chunk. Every group has the
    same number of layers (a kind with more layers is split into several groups; the last may be short), because
    one block holds the K/V of one group's layers and every block must be the same size: a block is
    `len(layers[0])` layer slots of the KV cache, whichever group holds it (engine/attention/kv_cache.py).
    """

    windows: tuple[Optional[int], ...]
    layers: tuple[tuple[int, ...], ...]
    chunks: tuple[Optional[int], ...]

    @classmethod
    def of(
        cls, layer_windows: Sequence[Optional[int]], max_model_len: int, layer_chunks: Sequence[Optional[int]] = ()
    ) -> "KVGroups":
        """Groups for layers with these windows (and chunks: () none). A window or a chunk that spans
        `max_model_len` reads every key, and is full attention as far as the cache goes."""
        if not layer_windows:
            raise ValueError("a model has at least one attention layer")
        chunks = tuple(layer_chunks) or (None,) * len(layer_windows)
        kinds: dict[tuple[Optional[int], Optional[int]], list[int]] = {}
        for layer, (window, chunk) in enumerate(zip(layer_windows, chunks, strict=True)):
            kind = (
                None if window is None or window >= max_model_len else window,
                None if chunk is None or chunk >= max_model_len else chunk,
            )
            kinds.setdefault(kind, []).append(layer)
        if (None, None) in kinds:  # full attention first (group 0)
            kinds = {(None, None): kinds.pop((None, None)), **kinds}
        size = min(len(layers) for layers in kinds.values())
        windows, group_chunks, groups = [], [], []
        for (window, chunk), layers in kinds.items():
            for start in range(0, len(layers), size):
                windows.append(window)
                group_chunks.append(chunk)
                groups.append(tuple(layers[start : start + size]))
        return cls(tuple(windows), tuple(groups), tuple(group_chunks))

    @classmethod
    def uniform(cls, num_layers: int) -> "KVGroups":
        """One group of full-attention layers."""
        return cls((None,), (tuple(range(num_layers)),), (None,))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_uniform(self) -> bool:
        """One group of full-attention layers."""
        return self.num_groups == 1 and self.windows[0] is None and not any(self.chunks)

    def held(self, layers: range) -> tuple[tuple[int, ...], ...]:
        """Each group's layers among `layers` (a pipeline stage's), counted from the first of them: the stage's
        cache layout. Every group stays, empty where the stage holds none of its layers: the scheduler hands
        out blocks by the whole model's groups, and a block id names the same group's rows on every stage."""
        return tuple(tuple(layer - layers.start for layer in group if layer in layers) for group in self.layers)
