"""Batch-invariant mode (`batch_invariant`, `--batch-invariant`): a request's tokens do not depend on its batch.

What else is in a step changes the shapes of the step's operations: the number of rows
of every matrix product, how a prompt is split into chunks (by the token budget the
others leave), whether a prompt continues a cached prefix. The default kernels pick
their blocking, and so the order in which they sum, by those shapes; in bfloat16 the
difference in rounding flips greedy tokens within a few dozen tokens (measured on the
embedded model: 3 of 4 prompts, 64 tokens, alone vs beside 1-8 others). In this mode
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

from typing import NamedTuple, Optional

import torch

from engine.attention import AttentionBackend
from engine.models.layer_ops import NativeLayerOps, TorchLayerOps
from engine.models.linear import Linear

INVARIANT_ATTENTION_BACKENDS = ("auto", "cpu")
"""The `attention_backend` values batch-invariant mode accepts (it brings its own variant of `cpu`)."""


class Numerics(NamedTuple):
    """The kernels a model runs with: attention, the per-token ops between products, the products
    (None: the model's defaults, plain torch ops / `select_linear`)."""

    backend: AttentionBackend
    ops: Optional[TorchLayerOps]
    linear: Optional[Linear]


def batch_invariant_numerics(attention_backend: str, device: torch.device, dtype: torch.dtype) -> Numerics:
    """The batch-invariant kernels for this device and dtype; ValueError saying why when there are none."""
    from engine.attention.invariant_backend import BatchInvariantCpuBackend
    from engine.kernels.cpu import KERNEL_DTYPES, load_cpu_kernels
    from engine.models.invariant_linear import BatchInvariantLinear

    if device.type != "cpu":
        raise ValueError(f"batch_invariant runs on CPU only for now (its kernels are native CPU ones), "
                         f"not on {device.type}")
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"batch_invariant runs float32 or bfloat16, not {str(dtype).removeprefix('torch.')}")
    if attention_backend not in INVARIANT_ATTENTION_BACKENDS:
        raise ValueError(f"batch_invariant brings its own attention (the cpu backend's paged kernel for every "
                         f"query); attention_backend must be auto or cpu, not {attention_backend!r}")
    kernels = load_cpu_kernels()
    if kernels is None:
        raise ValueError("batch_invariant needs the native CPU kernels, which did not build here "
                         "(see the warning above)")
    if not kernels.invariant_product_ok:
        raise ValueError("batch_invariant needs the native batch-invariant product, which failed its "
                         "self-check here (see the warning above)")
    return Numerics(BatchInvariantCpuBackend(kernels), NativeLayerOps(kernels), BatchInvariantLinear(kernels))
