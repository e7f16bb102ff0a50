"""The platform: the numerics a model runs with (which attention backend, per-token ops and matrix product) for its device,
dtype and settings. The attention backends and the model's layers are the parts; this
module alone picks them, so neither has to know the other.

    default          the attention backend `--attention-backend` names (auto: engine/attention/backend.py);
                     with the `cpu` backend, the native per-token ops and, in bfloat16 (and in float32 on
                     AVX2 and AVX-512 builds), the native product
    batch invariant  every part batch invariant (below)

Batch-invariant mode (`batch_invariant`, `--batch-invariant`): a request's tokens do not depend on its batch.

What else is in a step changes the shapes of the step's operations: the number of rows
of every matrix product, how a prompt is split into chunks (by the token budget the
others leave), whether a prompt continues a cached prefix. The default kernels pick
their blocking, and so the order in which they sum, by those shapes; in bfloat16 the
difference in rounding flips greedy tokens within a few dozen tokens (measured on the
embedded model: docs/batch-invariance.md). In this mode
every operation computes each row with arithmetic that depends on that row alone
(the idea of vLLM's VLLM_BATCH_INVARIANT and SGLang's --enable-deterministic-inference):

    products    BatchInvariantLinear: k summed in a fixed order, float32 accumulators
    norms, SiLU, RoPE   the native per-row kernels (NativeLayerOps)
    attention   BatchInvariantCpuBackend: every query token, prompt ones included, through
                the paged decode kernel, over its own context in a fixed block order

so chunked prefill, prefix-cache hits and preemption recomputes give the same bits too;
the sampler already treats rows independently (a seeded row's draw depends on its
seed and output position only). It runs on CPU, in float32 and bfloat16, and needs the native kernels.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import torch

from engine.errors import SettingsConflictError
from engine.attention import AttentionBackend, get_attention_backend
from engine.attention.attention_shape import AttentionShape
from engine.attention.kv_cache import KV_CACHE_DTYPES
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.kernels.amx import torch_bf16_products_use_amx
from engine.layers.invariant_linear import ColumnBlockLinear
from engine.layers.layer_ops import NativeLayerOps, TorchLayerOps
from engine.layers.linear import GemvLinear, Linear

logger = logging.getLogger(__name__)

INVARIANT_ATTENTION_BACKENDS = ("auto", "cpu")
"""The `attention_backend` values batch-invariant mode accepts (it brings its own variant of `cpu`)."""
AMX_GEMV_MAX_ROWS = 4
"""On AMX CPUs whose kernels lack the tile path, bf16 products beyond this many rows go to `F.linear` (oneDNN
on the tiles): measured in docs/performance.md."""


class Numerics(NamedTuple):
    """The kernels a model runs with: attention, the per-token ops between products, the products
    (None: the model's defaults, plain torch ops / `select_linear`)."""

    backend: AttentionBackend
    ops: Optional[TorchLayerOps]
    linear: Optional[Linear]


def choose_numerics(
    attention_backend: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    block_size: int,
    shape: AttentionShape,
    batch_invariant: bool = False,
    latent: bool = False,
    kv_cache_dtype: str = "auto",
    needs: frozenset[str] = frozenset(),
) -> Numerics:
    """The parts for this device and dtype; ValueError saying why when the settings cannot run here. `latent`:
    the model's attention is multi-head latent attention over a latent cache (auto then means torch);
    `kv_cache_dtype` as `--kv-cache-dtype` names it (auto then passes over a backend that cannot read it); `needs`
    the layer features the model uses, when known (auto then passes over a flash-attn that lacks one)."""
    if batch_invariant:
        return batch_invariant_numerics(attention_backend, device, dtype)
    if latent and attention_backend == "auto":
        # multi-head latent attention reads a latent cache that only the torch backend reads so far; a backend
        # named explicitly is checked against the model's layers at start-up (check_backend_serves)
        logger.info("attention backend auto: torch (multi-head latent attention)")
        attention_backend = "torch"
    backend = get_attention_backend(
        attention_backend,
        device,
        dtype,
        block_size=block_size,
        shape=shape,
        kv_cache_dtype=KV_CACHE_DTYPES.get(kv_cache_dtype),  # an unknown name: refused by resolve_kv_cache_dtype
        needs=needs,
    )
    if not isinstance(backend, CpuAttentionBackend):
        return Numerics(backend, None, None)
    return Numerics(backend, NativeLayerOps(backend.kernels), cpu_linear(backend, dtype))


def cpu_linear(backend: CpuAttentionBackend, dtype: torch.dtype) -> Optional[Linear]:
    """The product beside the cpu backend's kernels. bfloat16: the native column-block product at every row
    count where it runs on AVX512-BF16 and passed its load-time self-check; on AMX CPUs only with its tile
    path built in and granted (on vdpbf16ps alone it is slower than oneDNN on the tiles there). Else the
    native small-batch product up to 8 rows (AMX: 4) and torch's beyond. float32: the column-block product at
    every row count where it has vector tiles (AVX2 and AVX-512 builds; faster than oneDNN's packed weights or
    within 2% from 1 to 2,048 rows, and the decode steps fuse: docs/performance.md, "Float32 column blocks on AVX2"
    and "... on AVX-512"). Elsewhere float32 keeps oneDNN's packed weights (None)."""
    kernels = backend.kernels
    if dtype == torch.float32 and kernels.f32_column_blocks and kernels.invariant_product_ok:
        return ColumnBlockLinear(kernels, amx=False)
    if dtype != torch.bfloat16:
        return None
    amx_cpu = torch_bf16_products_use_amx()
    if kernels.bf16_column_blocks and kernels.invariant_product_ok and (kernels.amx_tiles or not amx_cpu):
        return ColumnBlockLinear(kernels)
    return GemvLinear(kernels, AMX_GEMV_MAX_ROWS) if amx_cpu else GemvLinear(kernels)


def batch_invariant_numerics(attention_backend: str, device: torch.device, dtype: torch.dtype) -> Numerics:
    """The batch-invariant kernels for this device and dtype; ValueError saying why when there are none."""
    from engine.attention.invariant_backend import BatchInvariantCpuBackend
    from engine.kernels.cpu import KERNEL_DTYPES, load_cpu_kernels
    from engine.layers.invariant_linear import BatchInvariantLinear

    if device.type != "cpu":
        raise SettingsConflictError(
            f"batch_invariant runs on CPU only for now (its kernels are native CPU ones), not on {device.type}"
        )
    if dtype not in KERNEL_DTYPES:
        raise SettingsConflictError(
            f"batch_invariant runs float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
        )
    if attention_backend not in INVARIANT_ATTENTION_BACKENDS:
        raise SettingsConflictError(
            f"batch_invariant brings its own attention (the cpu backend's paged kernel for every "
            f"query); attention_backend must be auto or cpu, not {attention_backend!r}"
        )
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SettingsConflictError(
            "batch_invariant needs the native CPU kernels, which did not build here (see the warning above)"
        )
    if not kernels.invariant_product_ok:
        raise SettingsConflictError(
            "batch_invariant needs the native batch-invariant product, which failed its "
            "self-check here (see the warning above)"
        )
    return Numerics(BatchInvariantCpuBackend(kernels), NativeLayerOps(kernels), BatchInvariantLinear(kernels))
