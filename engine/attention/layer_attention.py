"""What one layer's attention computes beyond plain causal softmax: its scale, sliding window, soft-cap,
attention sinks, and whether it attends over a latent cache (multi-head latent attention).

A model hands each layer's `LayerAttention` to the backend's `attend`; the backends read it, and a backend
that cannot compute one of its features says so at start-up (`check_backend_serves`), never at a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

import torch

SLIDING_WINDOW = "sliding window"
SOFTCAP = "attention soft-capping"
SINKS = "attention sinks"
FEATURES = (SLIDING_WINDOW, SOFTCAP)
"""What every backend computes; attention sinks only those that list SINKS in their `attention_features`."""
LATENT = "multi-head latent attention"
"""Not in FEATURES: only the backends that read the latent layout (engine/attention/kv_cache.py) list it."""


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """The scores of query position q over key position k (k <= q) of one layer:

        s = scale * (q . k)
        s = softcap * tanh(s / softcap)          when softcap is set
        k is seen only if k > q - sliding_window  when sliding_window is set (the query's own key included,
                                                  so `sliding_window` keys at most: HF's convention)
        k is seen only if k // chunk == q // chunk   when chunk is set (Llama 4's chunked local attention: computed
                                                  before the backend, which sees the step cut at the chunks'
                                                  boundaries as causal attention: attention/local_chunks.py)
        p = softmax over [s(k) for the seen k] + [sinks[h]], the sink's share dropped (it has no value):
            out = sum_k p_k v_k, so the weights of the keys sum to less than 1     when sinks is set (GPT-OSS)

    With `latent_rank` (multi-head latent attention, absorbed): one KV head whose keys are the cached latent
    entries [c_kv | k_pe] and whose values are their first `latent_rank` features; the queries come as
    [q_nope W_UK | q_pe] and the output has `latent_rank` features per head (the model applies W_UV).
    """

    scale: float
    sliding_window: Optional[int] = None
    softcap: Optional[float] = None
    # [num_heads] float32: a learned logit per query head joining the softmax's denominator. A tensor: left out
    # of equality and hashing, which compare the layer's settings.
    sinks: Optional[torch.Tensor] = field(default=None, compare=False)
    latent_rank: Optional[int] = None
    chunk: Optional[int] = None

    def __post_init__(self):
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"softcap must be > 0, got {self.softcap}")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")

    @property
    def features(self) -> frozenset[str]:
        used = set()
        if self.sliding_window is not None:
            used.add(SLIDING_WINDOW)
        if self.softcap is not None:
            used.add(SOFTCAP)
        if self.sinks is not None:
            used.add(SINKS)
        if self.latent_rank is not None:
            used.add(LATENT)
        return frozenset(used)

    def within(self, max_model_len: Optional[int]) -> "LayerAttention":
        """This attention over sequences of at most `max_model_len` tokens: a window that long or longer reads
        every key, and is dropped (the fused decode step and the kernels' unwindowed variants then serve it; the
        KV groups take it so too, engine/attention/kv_groups.py); so is a chunk that holds every position."""
        if not max_model_len:
            return self
        if self.chunk is not None and self.chunk >= max_model_len:
            return replace(self, chunk=None).within(max_model_len)
        if self.sliding_window is None or self.sliding_window < max_model_len:
            return self
        return replace(self, sliding_window=None)


def features_of(layers: Iterable[LayerAttention]) -> frozenset[str]:
    """Every feature some layer uses."""
    return frozenset().union(*(layer.features for layer in layers))


def missing_features(backend, layers: Iterable[LayerAttention]) -> frozenset[str]:
    """The features some layer uses that `backend` does not compute (it lists those it does in
    `attention_features`; none when absent)."""
    return features_of(layers) - frozenset(getattr(backend, "attention_features", ()))


def check_backend_serves(backend, layers: Iterable[LayerAttention], architecture: str) -> None:
    """ValueError naming the architecture, the backend and the feature when `backend` cannot compute
    a feature some layer uses. A backend lists what it computes in `attention_features` (none when absent)."""
    missing = sorted(missing_features(backend, layers))
    if missing:
        supported = sorted(getattr(backend, "attention_features", ()))
        raise ValueError(
            f"attention backend {backend.name!r} cannot serve {architecture}: it does not implement "
            f"{' or '.join(missing)} (it implements: {', '.join(supported) or 'none'}); "
            "choose another --attention-backend"
        )
