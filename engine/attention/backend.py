"""The attention backend interface and its selection."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata
from engine.runner.kv_cache import KVCacheSpec


class AttentionBackend(Protocol):
    """Paged attention over a KV cache laid out per layer as
    `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V."""

    name: str

    def prepare(self, metadata: AttentionMetadata, spec: KVCacheSpec) -> AttentionMetadata:
        """Once per step, before the first layer: add what this backend derives from the metadata."""
        ...

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
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
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of each query over its request's cached and new tokens."""
        ...


def get_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """`auto`: on CPU the native kernels when they build here, else (and on CUDA, until the flash and
    triton backends land) the torch backend. Naming `cpu` insists on the native kernels (an error if
    they cannot serve this device and dtype: float32 and bfloat16 on CPU)."""
    if name == "auto":
        if device.type == "cpu":
            backend = _cpu_backend(device, dtype, required=False)
            if backend is not None:
                return backend
        name = "torch"  # on CUDA until the flash / triton backends land (the GPU issue)
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        return _cpu_backend(device, dtype, required=True)
    if name in ("flash", "triton"):
        raise ValueError(f"attention backend {name!r} is not available in this build yet; use 'torch'")
    raise ValueError(f"unknown attention backend {name!r} (choose auto, cpu, torch)")


def _cpu_backend(device: torch.device, dtype: torch.dtype, required: bool):
    from engine.attention.cpu_backend import CpuAttentionBackend
    from engine.kernels.cpu import KERNEL_DTYPES, load_cpu_kernels

    if device.type != "cpu" or dtype not in KERNEL_DTYPES:
        if required:
            raise ValueError(f"attention backend 'cpu' runs float32/bfloat16 on CPU, not {dtype} on {device.type}")
        return None
    kernels = load_cpu_kernels()
    if kernels is None:
        if required:
            raise ValueError("attention backend 'cpu' needs its native kernels, which did not build here "
                             "(see the warning above); use 'torch'")
        return None
    return CpuAttentionBackend(kernels)
