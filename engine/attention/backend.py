"""The attention backend interface and its selection."""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol

import torch

from engine.errors import SettingsConflictError
from engine.attention.attention_shape import AttentionShape
from engine.attention.step_metadata import StepMetadata
from engine.attention.kv_cache import KVCacheSpec, kv_cache_dtype_name
from engine.attention.layer_attention import LayerAttention

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    """Paged attention over a KV cache laid out per layer as
    `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V."""

    name: str
    cuda_graphs: bool
    """Whether a decode step can be captured as a CUDA graph: `build_metadata` and the kernels read the
    step's device tensors only (no host value decides a shape or a launch), given the fixed `max_seq_len`
    and full-width block table of engine/runner/cuda_graphs.py."""

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The KV cache dtypes this backend reads for a model computing in `model_dtype`
        (`--kv-cache-dtype` must name one of them; auto is the model's own)."""
        ...

    def build_metadata(self, step: StepMetadata, spec: KVCacheSpec) -> Any:
        """Once per step, before the first layer: this backend's own metadata from the step's (which
        the runner wrote into its persistent buffers); every layer's `write_kv` and `attend` get it."""
        ...

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: Any,
    ) -> None:
        """Store the new tokens' K/V at `metadata.slot_mapping`."""
        ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (this step's, already written)
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: Any,
        layer: LayerAttention,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of each query over its request's cached and new tokens, with the layer's scale,
        sliding window and soft-cap."""
        ...


def get_attention_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    block_size: Optional[int] = None,
    shape: Optional[AttentionShape] = None,
    kv_cache_dtype: Optional[torch.dtype] = None,
    needs: frozenset[str] = frozenset(),
) -> AttentionBackend:
    """The backend `name` names, for this device, dtype and KV block size (None: not known, which rules
    flash-attn 2 out). With the model's attention `shape` (and the block size), flash-attn is chosen only
    once one tiny paged call of exactly that configuration has run on the device (engine/attention/probe.py).

    `auto`: on CPU the native kernels when they build here and read the KV cache's dtype (`kv_cache_dtype`,
    None: the model's), else the torch backend; on CUDA flash-attn when it imports, fits the block size and
    reads the KV cache's dtype, else the triton backend when it is available, else torch (`cuda_auto_choice`). The choice and
    the reason are logged. Naming `cpu` or `flash` insists: a ValueError saying why it cannot serve here and
    what to do instead. `needs`: the layer features the model uses (layer_attention.py); `auto` on CUDA passes
    over a flash-attn release that does not compute one of them."""
    if name == "auto":
        if device.type == "cuda":
            return _cuda_auto(device, dtype, block_size, shape, kv_cache_dtype, needs)
        if device.type == "cpu":
            backend = _cpu_backend(device, dtype, required=False)
            if backend is not None and kv_cache_dtype in (None, *backend.kv_cache_dtypes(dtype)):
                return backend
            if backend is not None and kv_cache_dtype is not None:  # the torch backend reads every cache dtype
                cache = kv_cache_dtype_name(kv_cache_dtype)
                logger.info(
                    "attention backend auto on CPU: torch (the native kernels do not read a %s KV cache; the torch "
                    "backend's per-token ops and products come with it, slower than the native ones)",
                    cache,
                )
        name = "torch"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        return _cpu_backend(device, dtype, required=True)
    if name == "flash":
        return _flash_backend(device, dtype, block_size, shape)
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend, triton_unavailable_reason

        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise SettingsConflictError(f"attention backend 'triton': {reason}")
        return TritonAttentionBackend()
    raise SettingsConflictError(f"unknown attention backend {name!r} (choose auto, cpu, torch, flash, triton)")


def cuda_auto_choice(flash_available: bool, triton_available: bool) -> str:
    """`auto`'s order on CUDA: flash-attn (when it imports and fits the block size), then our Triton
    kernels, then the torch reference."""
    if flash_available:
        return "flash"
    if triton_available:
        return "triton"
    return "torch"


def _triton_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the triton backend can serve this device (Triton installed; CUDA)."""
    from engine.attention.triton_backend import triton_unavailable_reason

    return device.type == "cuda" and triton_unavailable_reason(device) is None


def _cuda_auto(
    device: torch.device,
    dtype: torch.dtype,
    block_size: Optional[int],
    shape: Optional[AttentionShape],
    kv_cache_dtype: Optional[torch.dtype],
    needs: frozenset[str],
) -> AttentionBackend:
    from engine.attention.flash_backend import FlashAttentionBackend, find_flash_kernel

    if kv_cache_dtype not in (None, dtype):  # flash-attn reads K/V in the query's dtype only
        cache = kv_cache_dtype_name(kv_cache_dtype)
        choice = cuda_auto_choice(False, _triton_available(device, dtype))
        logger.info("attention backend auto on CUDA: %s (flash-attn does not read a %s KV cache)", choice, cache)
        return get_attention_backend(choice, device, dtype, block_size=block_size)
    search = find_flash_kernel(device, dtype, block_size, shape, needs=needs)
    choice = cuda_auto_choice(search.kernel is not None, _triton_available(device, dtype))
    logger.info("attention backend auto on CUDA: %s (%s)", choice, search.summary)
    if search.kernel is not None and choice == "flash":
        return FlashAttentionBackend(search.kernel)
    return get_attention_backend(choice, device, dtype, block_size=block_size)


def _flash_backend(
    device: torch.device, dtype: torch.dtype, block_size: Optional[int], shape: Optional[AttentionShape]
) -> AttentionBackend:
    from engine.attention.flash_backend import FlashAttentionBackend, find_flash_kernel

    search = find_flash_kernel(device, dtype, block_size, shape)
    if search.kernel is None:
        raise SettingsConflictError(
            f"attention backend 'flash' cannot run here: {search.summary}. {_flash_remedy(device, dtype)}"
        )
    logger.info("attention backend flash: %s", search.summary)
    return FlashAttentionBackend(search.kernel)


def _flash_remedy(device: torch.device, dtype: torch.dtype) -> str:
    from engine.attention.flash_backend import FLASH_ATTN_2_BLOCK_MULTIPLE, FLASH_DTYPES

    if device.type != "cuda":
        return "Use auto, cpu or torch off CUDA."
    if dtype not in FLASH_DTYPES:
        return "Set --dtype bfloat16 (or float16), or use auto / torch."
    return (
        f"Install flash-attn-4 (Hopper or newer, any block size), or run flash-attn 2 with "
        f"--block-size {FLASH_ATTN_2_BLOCK_MULTIPLE} (or another multiple of {FLASH_ATTN_2_BLOCK_MULTIPLE}), "
        "or use auto / torch."
    )


def _cpu_backend(device: torch.device, dtype: torch.dtype, required: bool):
    from engine.attention.cpu_backend import CpuAttentionBackend
    from engine.kernels.cpu import KERNEL_DTYPES, load_cpu_kernels

    if device.type != "cpu" or dtype not in KERNEL_DTYPES:
        if required:
            raise SettingsConflictError(
                f"attention backend 'cpu' runs float32/bfloat16 on CPU, not {dtype} on {device.type}"
            )
        return None
    kernels = load_cpu_kernels()
    if kernels is None:
        if required:
            raise SettingsConflictError(
                "attention backend 'cpu' needs its native kernels, which did not build here "
                "(see the warning above); use 'torch'"
            )
        return None
    return CpuAttentionBackend(kernels)
