"""The physical paged KV cache: one K and one V tensor per layer, in the KV cache dtype (or, for multi-head
latent attention, one tensor of latent entries per layer whose values are their first features).

The cache may store a narrower dtype than the model computes in (`--kv-cache-dtype`): bfloat16 for
an fp32 model halves the cache's bytes (twice the tokens in the same budget) and what decode
attention reads; fp8 quarters them (halves a bf16 model's): e4m3 (`fp8`, `fp8_e4m3`: 3 mantissa bits, +-448)
or e5m2 (`fp8_e5m2`: 2 mantissa bits, +-57344), as vLLM names them. The attention backends convert on write
(the new K/V to the cache's dtype, divided by `kv_scale` for fp8) and on read (back to the query's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from engine.errors import SettingsConflictError
from engine.huge_pages import advise_huge_pages

import torch

KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_KV_SCALE = 1.0
"""K/V = stored value x scale. Without scales calibrated for the checkpoint every layer uses 1.0 (vLLM's
default too): e4m3 spans +-448, well beyond the K/V activations of Llama-family models."""


class ReadsKVCache(Protocol):
    """What the KV cache dtype's resolution asks of an attention backend."""

    name: str

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]: ...


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, backend: ReadsKVCache) -> torch.dtype:
    """The cache's torch dtype for `--kv-cache-dtype` (auto: the model's), one that `backend` reads;
    ValueError naming the flag otherwise."""
    if name != "auto" and name not in KV_CACHE_DTYPES:
        raise SettingsConflictError(f"--kv-cache-dtype {name!r}: choose auto, {', '.join(KV_CACHE_DTYPES)}")
    dtype = model_dtype if name == "auto" else KV_CACHE_DTYPES[name]
    accepted = backend.kv_cache_dtypes(model_dtype)
    if dtype not in accepted:
        names = ", ".join(dict.fromkeys(kv_cache_dtype_name(d) for d in accepted))
        # batch-invariant mode keeps its own backend: no other to name there
        remedy = "" if "invariant" in backend.name else " or --attention-backend torch, which reads every cache dtype"
        raise SettingsConflictError(
            f"--kv-cache-dtype {name}: the {backend.name} attention backend reads a KV cache of "
            f"{names} for a {kv_cache_dtype_name(model_dtype)} model; use one of those (auto: the model's "
            f"dtype){remedy}"
        )
    return dtype


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """A dtype as `--kv-cache-dtype` names it: "fp8" for float8_e4m3fn, "fp8_e5m2" for float8_e5m2."""
    return next((flag for flag, each in KV_CACHE_DTYPES.items() if each == dtype), str(dtype).removeprefix("torch."))


def kv_scale(dtype: torch.dtype) -> float:
    """What a stored K/V element is multiplied by when read (1 unless the cache is fp8)."""
    return FP8_KV_SCALE if is_fp8(dtype) else 1.0


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` holds one-byte floats (e4m3 or e5m2)."""
    return dtype in FP8_DTYPES


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New K or V in the cache's dtype (scaled into fp8's range when the cache is fp8)."""
    if x.dtype == cache_dtype:
        return x
    if is_fp8(cache_dtype):  # saturated at the format's largest finite value (torch clamps e4m3, not e5m2)
        limit = torch.finfo(cache_dtype).max
        return (x.float() / kv_scale(cache_dtype)).clamp_(-limit, limit).to(cache_dtype)
    return x.to(cache_dtype)


def as_stored(x: torch.Tensor) -> torch.Tensor:
    """`x` viewed as its bytes when it is fp8 (index_copy_ / index_select have no float8 kernels), else `x`."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x


def select_blocks(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`cache.index_select(0, index)`, fp8 caches included."""
    return as_stored(cache).index_select(0, index).view(cache.dtype)


def values_in_keys(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether `value_cache` is a latent cache's view of its entries (written with them, never on its own)."""
    return value_cache.data_ptr() == key_cache.data_ptr()


def from_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V (any shape) in the compute dtype `dtype`."""
    if x.dtype == dtype:
        return x
    if is_fp8(x.dtype):
        return (x.to(torch.float32) * kv_scale(x.dtype)).to(dtype)
    return x.to(dtype)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of one layer's cache block.

    With `latent_rank` set the layout is multi-head latent attention's (DeepSeek-V2/V3): per token and layer
    one entry `[c_kv | k_pe]` of `head_dim` = kv_lora_rank + qk_rope_head_dim features (`num_kv_heads` 1),
    the compressed latent and the rotated shared key, never the expanded heads; the values are each entry's
    first `latent_rank` (= kv_lora_rank) features, so there is no V tensor of their own.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    latent_rank: Optional[int] = None
    layer_groups: tuple[tuple[int, ...], ...] = ()  # the layers of each block-table group (KVGroups); () one

    def __post_init__(self):
        if self.layer_groups and sorted(i for layers in self.layer_groups for i in layers) != list(
            range(self.num_layers)
        ):
            raise ValueError(f"layer groups {self.layer_groups} do not cover layers 0 .. {self.num_layers - 1} once")
        if self.latent_rank is not None and (self.num_kv_heads != 1 or not 0 < self.latent_rank <= self.head_dim):
            raise ValueError(
                f"a latent KV cache has one entry per token (num_kv_heads 1, not {self.num_kv_heads}) "
                f"whose first latent_rank {self.latent_rank} of {self.head_dim} features are the values"
            )

    @classmethod
    def latent(
        cls, num_layers: int, block_size: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype
    ) -> "KVCacheSpec":
        """Multi-head latent attention's layout: `kv_lora_rank + rope_dim` values per token and layer."""
        return cls(num_layers, block_size, 1, kv_lora_rank + rope_dim, dtype, latent_rank=kv_lora_rank)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The layers of each group (one group of every layer unless the spec says otherwise)."""
        return self.layer_groups or (tuple(range(self.num_layers)),)

    @property
    def group_of_layer(self) -> tuple[int, ...]:
        """Each layer's group (whose block table and slot mapping it reads and writes through)."""
        group_of = {layer: group for group, layers in enumerate(self.groups) for layer in layers}
        return tuple(group_of[layer] for layer in range(self.num_layers))

    @property
    def slots_per_block(self) -> int:
        """Layers whose K/V one block holds: a group's (the largest)."""
        return max(len(layers) for layers in self.groups)

    @property
    def tensors_per_layer(self) -> int:
        """K and V apart (2), or the latent entries alone (1)."""
        return 1 if self.latent_rank is not None else 2

    @property
    def bytes_per_token(self) -> int:
        """What one token's cache takes over every layer (its slot in every group's block)."""
        return len(self.groups) * self.bytes_per_block // self.block_size

    @property
    def bytes_per_block(self) -> int:
        """K and V (or the latent entries) of one block: `block_size` tokens in each of a group's layers."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        layer_bytes = self.tensors_per_layer * self.num_kv_heads * self.head_dim * element_size
        return self.block_size * self.slots_per_block * layer_bytes

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


class KVCache:
    """Per layer, K and V of shape `[num_blocks + 1, block_size, num_kv_heads, head_dim]`
    (the layout flash-attn's paged kernels read). The scheduler's KVCacheManager
    decides which of blocks 0 .. num_blocks - 1 belong to whom; this class only holds
    the memory. The last block, `pad_block`, is never handed out: the padding rows of a
    CUDA-graph step write and read it (engine/runner/cuda_graphs.py), and a sliding-window group's freed
    entries name it (never read: they lie behind the window). A latent spec's layer is its one
    tensor of entries `[num_blocks + 1, block_size, 1, kv_lora_rank + rope_dim]` and, as V, the view of their
    first kv_lora_rank features.

    With several layer groups (KVGroups) the memory is `slots_per_block` tensors (K and V each), and the i-th
    layer of every group reads and writes the i-th: a block id, which the scheduler gives to one group at a
    time, names that block's rows in every slot tensor, holding K/V of that group's layers only. So groups
    share one pool of equal blocks, and `layers[l]` is the slot tensor of layer l (shared with other groups'
    layers, through other block ids)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        shape = (num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.spec = spec
        self.num_blocks = num_blocks
        self.pad_block = num_blocks
        slots = [self._layer(spec, shape, device) for _ in range(spec.slots_per_block)]
        slot_of_layer = {layer: slot for layers in spec.groups for slot, layer in enumerate(layers)}
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            slots[slot_of_layer[layer]] for layer in range(spec.num_layers)
        ]

    @staticmethod
    def _layer(spec: KVCacheSpec, shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V); for a latent spec (entries, their first latent_rank features): a view, no second tensor.
        On a CPU both are advised to 2 MB pages before they are first written (engine/huge_pages.py)."""
        count = 1 if spec.latent_rank is not None else 2
        tensors = [torch.empty(shape, dtype=spec.dtype, device=device) for _ in range(count)]
        advise_huge_pages(tensors, collapse=False)
        keys = tensors[0].zero_()
        if spec.latent_rank is not None:
            return keys, keys[..., : spec.latent_rank]
        return keys, tensors[1].zero_()

    def release(self) -> None:
        """Drop the tensors (the engine is shutting down); the spec stays for what describes the cache."""
        self.layers = []

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block
