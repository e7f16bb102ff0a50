"""The attention backend interface and its selection."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

from engine.attention.step_metadata import StepMetadata
from engine.runner.kv_cache import KVCacheSpec

if TYPE_CHECKING:
    from engine.models.layer_ops import TorchLayerOps


class AttentionBackend(Protocol):
    """Paged attention over a KV cache laid out per layer as
    `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V."""

    name: str

    def build_metadata(self, step: StepMetadata, spec: KVCacheSpec) -> Any:
        """Once per step, before the first layer: this backend's own metadata from the step's (which
        the runner wrote into its persistent buffers); every layer's `write_kv` and `attend` get it."""
        ...

    def layer_ops(self) -> Optional["TorchLayerOps"]:
        """The per-token ops (norms, SiLU-and-mul, RoPE) this backend brings, or None for plain torch's."""
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
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend, triton_unavailable_reason

        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"attention backend 'triton': {reason}")
        return TritonAttentionBackend()
    if name == "flash":
        raise ValueError(f"attention backend {name!r} is not available in this build yet; use 'torch'")
    raise ValueError(f"unknown attention backend {name!r} (choose auto, cpu, torch, triton)")


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
