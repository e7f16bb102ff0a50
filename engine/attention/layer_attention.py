"""What one layer's attention computes beyond plain causal softmax: its scale, sliding window, soft-cap and
attention sinks.

A model hands each layer's `LayerAttention` to the backend's `attend`; the backends read it, and a backend
that cannot compute one of its features says so at start-up (`check_backend_serves`), never at a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

SLIDING_WINDOW = "sliding window"
SOFTCAP = "attention soft-capping"
SINKS = "attention sinks"
FEATURES = (SLIDING_WINDOW, SOFTCAP)
"""What every backend computes; attention sinks only those that list SINKS in their `attention_features`."""


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """The scores of query position q over key position k (k <= q) of one layer:

        s = scale * (q . k)
        s = softcap * tanh(s / softcap)          when softcap is set
        k is seen only if k > q - sliding_window  when sliding_window is set (the query's own key included,
                                                  so `sliding_window` keys at most: HF's convention)
        p = softmax over [s(k) for the seen k] + [sinks[h]], the sink's share dropped (it has no value):
            out = sum_k p_k v_k, so the weights of the keys sum to less than 1     when sinks is set (GPT-OSS)
    """

    scale: float
    sliding_window: Optional[int] = None
    softcap: Optional[float] = None
    # [num_heads] float32: a learned logit per query head joining the softmax's denominator. A tensor: left out
    # of equality and hashing, which compare the layer's settings.
    sinks: Optional[torch.Tensor] = field(default=None, compare=False)

    def __post_init__(self):
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"softcap must be > 0, got {self.softcap}")

    @property
    def features(self) -> frozenset[str]:
        used = set()
        if self.sliding_window is not None:
            used.add(SLIDING_WINDOW)
        if self.softcap is not None:
            used.add(SOFTCAP)
        if self.sinks is not None:
            used.add(SINKS)
        return frozenset(used)


def check_backend_serves(backend, layers: Iterable[LayerAttention], architecture: str) -> None:
    """ValueError naming the architecture, the backend and the feature when `backend` cannot compute
    a feature some layer uses. A backend lists what it computes in `attention_features` (none when absent)."""
    supported = frozenset(getattr(backend, "attention_features", ()))
    needed = frozenset().union(*(layer.features for layer in layers))
    missing = sorted(needed - supported)
    if missing:
        raise ValueError(f"attention backend {backend.name!r} cannot serve {architecture}: it does not implement "
                         f"{' or '.join(missing)} (it implements: {', '.join(sorted(supported)) or 'none'}); "
                         "choose another --attention-backend")
