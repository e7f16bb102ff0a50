"""The flash-attn backend: one varlen paged call per layer for the whole step (decodes and prefill chunks).

Two implementations read the cache layout `[num_blocks, block_size, num_kv_heads, head_dim]` in place:

    flash-attn 4  flash_attn.cute.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=, seqused_k=,
                  page_table=, max_seqlen_q=, softmax_scale=, causal=True) -> (out, lse)
                  Hopper or newer; any block size.
    flash-attn 2  flash_attn.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=, cu_seqlens_k=,
                  max_seqlen_q=, max_seqlen_k=, softmax_scale=, causal=True, block_table=) -> out
                  Ampere or newer; block size a multiple of 256 (its paged kernels' limit).

Both align the causal mask to the bottom right: query i of a request with q query tokens and
k cached tokens (this step's included) sees keys 0 .. k - q + i, i.e. positions up to its own.
A layer's sliding window W goes in as `window_size=(W - 1, 0)` (keys k - q + i - W + 1 .. k - q + i, HF's
`kv_idx > q_idx - W`), its soft-cap as `softcap=`, to releases whose varlen function takes them.
Which one runs is decided once, by `find_flash_kernel`, when the backend is chosen: by what imports
and what the GPU and block size allow, then by a probe (engine/attention/probe.py) that runs one tiny
paged step of the model's exact configuration, since a signature does not say what the kernels accept.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch

from engine.attention.attention_shape import AttentionShape
from engine.attention.kv_write import write_kv_by_slots
from engine.attention.layer_attention import SINKS, SLIDING_WINDOW, SOFTCAP, LayerAttention
from engine.attention.probe import probe_backend
from engine.attention.step_metadata import StepMetadata, check_causal
from engine.attention.kv_cache import KVCacheSpec

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_ATTN_2_BLOCK_MULTIPLE = 256
"""flash-attn 2's paged kernels need `block_size % 256 == 0` ("Paged KV cache block size must be divisible by 256")."""
FLASH_ATTN_2_HEAD_DIM_MULTIPLE = 8
"""flash-attn 2's kernels take head dims in multiples of 8; its Python wrapper pads q, k and v to one."""
FLASH_ATTN_4_MIN_CAPABILITY = (9, 0)
"""flash-attn 4's sm80 path rejects a page table; on sm90 and newer paging depends on the release and the
head dim (before 4.0.0b5 sm90 asserted on it; sm12x still does), which the start-up probe finds out."""


@dataclass(frozen=True, slots=True)
class FlashKernel:
    """The flash-attn implementation found at start-up: its major version and varlen entry point."""

    major: int  # 2 or 4
    version: str  # the installed distribution's version
    varlen: Callable[..., Any]  # flash_attn_varlen_func
    takes_max_seqlen_q: bool = True  # early flash-attn 4 releases had no max_seqlen_q argument
    takes_window: bool = True  # window_size= (flash-attn 2 since 2.3)
    takes_softcap: bool = True  # softcap= (flash-attn 2 since 2.6)
    takes_sinks: bool = False  # learnable_sink= (flash-attn 4's cute interface; never flash-attn 2)

    @property
    def label(self) -> str:
        return f"flash-attn {self.major}"


class FlashSearch(NamedTuple):
    """What `find_flash_kernel` found: the kernel to use (None: none fits), and why, per candidate."""

    kernel: Optional[FlashKernel]
    reasons: tuple[str, ...]

    @property
    def summary(self) -> str:
        return "; ".join(self.reasons)


def find_flash_kernel(
    device: torch.device,
    dtype: torch.dtype,
    block_size: Optional[int],
    shape: Optional[AttentionShape] = None,
    *,
    generations: tuple[int, ...] = (4, 2),
    needs: frozenset[str] = frozenset(),
) -> FlashSearch:
    """The flash-attn implementation that can serve this device, dtype and KV block size: flash-attn 4
    when it imports on a Hopper or newer GPU, else flash-attn 2 when it imports and the block size is
    a multiple of 256 (`block_size` None: not known, which rules flash-attn 2 out). Imports them.

    With `shape` (the model's heads and head dim) and a block size, each candidate must also run one
    tiny paged step of exactly that configuration on the device and agree with a float32 reference
    (engine/attention/probe.py): a release or GPU whose kernels assert on it is passed over, with why.
    `generations` limits the search (the GPU check measures each installed one on its own). `needs`: the
    layer features (engine/attention/layer_attention.py) the model's layers use; a release whose varlen
    function does not take one of them (flash-attn 2 has no attention sinks) is passed over, with why."""
    if device.type != "cuda":
        return FlashSearch(None, (f"flash-attn runs on CUDA, not {device.type}",))
    if dtype not in FLASH_DTYPES:
        return FlashSearch(None, (f"flash-attn runs float16/bfloat16, not {_dtype_name(dtype)}",))
    reasons: list[str] = []
    if 4 in generations:
        kernel = _flash_attn_4(device, reasons)
        if (
            kernel is not None
            and _computes(kernel, needs, reasons)
            and _passes_probe(kernel, device, dtype, block_size, shape, reasons)
        ):
            return FlashSearch(
                kernel,
                (
                    *reasons,
                    f"flash-attn 4 {kernel.version}: paged varlen kernels, any block size{_probed(shape, block_size)}",
                ),
            )
    if 2 in generations:
        kernel = _import_flash_attn_2(reasons)
        if kernel is None:
            return FlashSearch(None, tuple(reasons))
        if block_size is None or block_size % FLASH_ATTN_2_BLOCK_MULTIPLE:
            given = "the block size is not known" if block_size is None else f"not {block_size}"
            reasons.append(
                f"flash-attn 2 {kernel.version}: its paged kernels need a KV block size that is a multiple "
                f"of {FLASH_ATTN_2_BLOCK_MULTIPLE}, {given}"
            )
            return FlashSearch(None, tuple(reasons))
        if shape is not None and shape.head_dim % FLASH_ATTN_2_HEAD_DIM_MULTIPLE:
            reasons.append(
                f"flash-attn 2 {kernel.version}: head dim {shape.head_dim} is not a multiple of "
                f"{FLASH_ATTN_2_HEAD_DIM_MULTIPLE} (its wrapper would pad, so copy, every layer's whole "
                "paged cache at every call)"
            )
            return FlashSearch(None, tuple(reasons))
        if _computes(kernel, needs, reasons) and _passes_probe(kernel, device, dtype, block_size, shape, reasons):
            return FlashSearch(
                kernel,
                (*reasons, f"flash-attn 2 {kernel.version}: block size {block_size} fits{_probed(shape, block_size)}"),
            )
    return FlashSearch(None, tuple(reasons))


def flash_versions() -> dict[str, Optional[str]]:
    """The installed flash-attn distributions' versions (None: not installed), without importing them:
    flash-attn 4 installs `flash_attn.cute` into a namespace package with no `__version__`."""
    versions: dict[str, Optional[str]] = {}
    for distribution in ("flash-attn", "flash-attn-4"):
        try:
            versions[distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[distribution] = None
    return versions


def _flash_attn_4(device: torch.device, reasons: list[str]) -> Optional[FlashKernel]:
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability < FLASH_ATTN_4_MIN_CAPABILITY:
        reasons.append(
            f"flash-attn 4: needs compute capability 9.0 or newer (Hopper+), this GPU has "
            f"{capability[0]}.{capability[1]}"
        )
        return None
    return _import_flash_attn_4(reasons)


def _computes(kernel: FlashKernel, needs: frozenset[str], reasons: list[str]) -> bool:
    """Whether `kernel` takes every layer feature in `needs` (else why not, in `reasons`)."""
    missing = sorted(needs - frozenset(FlashAttentionBackend(kernel).attention_features))
    if missing:
        reasons.append(
            f"{kernel.label} {kernel.version}: its varlen function does not compute {' or '.join(missing)}, "
            "which the model's layers use"
        )
    return not missing


def _passes_probe(
    kernel: FlashKernel,
    device: torch.device,
    dtype: torch.dtype,
    block_size: Optional[int],
    shape: Optional[AttentionShape],
    reasons: list[str],
) -> bool:
    if shape is None or block_size is None:
        return True  # nothing to probe with: callers that serve a model pass both
    failure = probe_backend(FlashAttentionBackend(kernel), shape, block_size, dtype, device)
    if failure is not None:
        reasons.append(
            f"{kernel.label} {kernel.version}: {failure} with {_dtype_name(dtype)}, "
            f"{shape.num_heads}/{shape.num_kv_heads} heads of dim {shape.head_dim}, block size {block_size}"
        )
    return failure is None


def _probed(shape: Optional[AttentionShape], block_size: Optional[int]) -> str:
    if shape is None or block_size is None:
        return ""
    return (
        f"; its probe of {shape.num_heads}/{shape.num_kv_heads} heads of dim {shape.head_dim}, "
        f"block size {block_size} passed"
    )


def _import_flash_attn_4(reasons: list[str]) -> Optional[FlashKernel]:
    varlen = _import_function("flash_attn.cute", "flash_attn_varlen_func", "flash-attn 4", reasons)
    if varlen is None:
        return None
    params = _parameters(varlen)
    missing = [name for name in ("cu_seqlens_q", "seqused_k", "page_table") if name not in (params or {name})]
    if missing:
        reasons.append(
            f"flash-attn 4: this release's flash_attn_varlen_func has no {', '.join(missing)}; upgrade flash-attn-4"
        )
        return None
    return FlashKernel(
        4,
        _version(("flash-attn-4", "fa4"), "flash_attn.cute"),
        varlen,
        takes_max_seqlen_q=params is None or "max_seqlen_q" in params,
        **_layer_options(params),
    )


def _import_flash_attn_2(reasons: list[str]) -> Optional[FlashKernel]:
    varlen = _import_function("flash_attn", "flash_attn_varlen_func", "flash-attn 2", reasons)
    if varlen is None:
        return None
    params = _parameters(varlen)
    if params is not None and "block_table" not in params:
        reasons.append(
            "flash-attn 2: this release's flash_attn_varlen_func has no block_table (paged KV came "
            "in 2.5); upgrade flash-attn"
        )
        return None
    return FlashKernel(2, _version(("flash-attn",), "flash_attn"), varlen, **_layer_options(params))


def _layer_options(params: Optional[frozenset[str]]) -> dict[str, bool]:
    """Whether the varlen function takes a sliding window and a soft-cap (no signature: trusted), and attention
    sinks (only when its signature names `learnable_sink`: no release is assumed to)."""
    return {
        "takes_window": params is None or "window_size" in params,
        "takes_softcap": params is None or "softcap" in params,
        "takes_sinks": params is not None and "learnable_sink" in params,
    }


def _import_function(module_name: str, attribute: str, label: str, reasons: list[str]) -> Optional[Callable]:
    """`module.attribute`, or None with the reason noted (not installed, or installed but not loading)."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and f"{module_name}.".startswith(f"{exc.name}."):  # the module or its package
            reasons.append(f"{label}: not installed (no module {module_name})")
        else:
            reasons.append(f"{label}: {module_name} does not import (ModuleNotFoundError: {exc})")
        return None
    except Exception as exc:  # a CUDA extension can also fail with OSError / RuntimeError
        reasons.append(f"{label}: {module_name} does not import ({type(exc).__name__}: {exc})")
        return None
    function = getattr(module, attribute, None)
    if function is None:
        reasons.append(f"{label}: {module_name} has no {attribute} (not installed)")
    return function


def _parameters(function: Callable) -> Optional[frozenset[str]]:
    try:
        return frozenset(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return None


def _version(distributions: tuple[str, ...], module_name: str) -> str:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return str(getattr(importlib.import_module(module_name), "__version__", "unknown version"))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class FlashMetadata:
    """One step as flash-attn reads it (views of the step's persistent buffers, plus flash-attn 2's
    cumulative KV lengths):

        cu_seqlens_q  [0, q0, q0+q1, ...]     query rows of each request in the flat batch
        seqused_k     [k0, k1, ...]           KV tokens of each request, this step's included
        cu_seqlens_k  [0, k0, k0+k1, ...]     the same, cumulative (flash-attn 2's paged varlen reads these)
        page_table    [num_reqs, max_blocks]  block ids of each request, in order
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32
    seqused_k: torch.Tensor  # [num_reqs] int32
    cu_seqlens_k: Optional[torch.Tensor]  # [num_reqs + 1] int32, flash-attn 2 only
    page_table: torch.Tensor  # [num_reqs, max_blocks] int32, last dimension contiguous
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


class FlashAttentionBackend:
    """Writes K/V through `slot_mapping`, then one flash-attn varlen call over the paged cache per layer."""

    cuda_graphs = True  # device views of the step, host ints fixed per graph (max_seqlen_q 1, max_seqlen_k)

    def __init__(self, kernel: FlashKernel):
        self.kernel = kernel
        self.name = f"flash ({kernel.label})"
        self.attention_features = tuple(
            feature
            for feature, taken in (
                (SLIDING_WINDOW, kernel.takes_window),
                (SOFTCAP, kernel.takes_softcap),
                (SINKS, kernel.takes_sinks),
            )
            if taken
        )
        self._cu_seqlens_k: Optional[torch.Tensor] = None  # flash-attn 2: [capacity + 1] int32, grown on demand

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (model_dtype,)  # both generations check that K/V have the query's dtype

    def build_metadata(self, step: StepMetadata, spec: KVCacheSpec) -> FlashMetadata:
        check_causal(step, self.name)
        cu_seqlens_k = None
        if self.kernel.major == 2:
            cu_seqlens_k = self._cumulative_kv_lens(step.seq_lens)
        return FlashMetadata(
            slot_mapping=step.slot_mapping,
            cu_seqlens_q=step.query_start_loc,
            seqused_k=step.seq_lens,
            cu_seqlens_k=cu_seqlens_k,
            page_table=step.block_table,
            max_seqlen_q=step.max_query_len,
            max_seqlen_k=step.max_seq_len,
        )

    def _cumulative_kv_lens(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """[0, k0, k0+k1, ...] on the device, into a buffer kept across steps (no host round trip). CUDA graphs
        capture its address: it must not grow after capture, which holds since the memory profile and each
        graph's warm-up (largest bucket first) build metadata for max_num_seqs requests before any capture."""
        num_reqs = seq_lens.shape[0]
        buffer = self._cu_seqlens_k
        if buffer is None or buffer.shape[0] < num_reqs + 1 or buffer.device != seq_lens.device:
            buffer = self._cu_seqlens_k = torch.zeros(max(num_reqs + 1, 64), dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, dtype=torch.int32, out=buffer[1 : num_reqs + 1])
        return buffer[: num_reqs + 1]

    def write_kv(self, key, value, key_cache, value_cache, metadata: FlashMetadata) -> None:
        write_kv_by_slots(key, value, key_cache, value_cache, metadata.slot_mapping)

    def attend(self, query, key, value, key_cache, value_cache, metadata: FlashMetadata, layer: LayerAttention):
        """query [num_tokens, heads, head_dim] over the cache (this step's K/V already written)."""
        extra = _layer_arguments(layer)  # only what the layer uses: releases without them still serve the rest
        if self.kernel.major == 2:
            return self.kernel.varlen(
                query,
                key_cache,
                value_cache,
                cu_seqlens_q=metadata.cu_seqlens_q,
                cu_seqlens_k=metadata.cu_seqlens_k,
                max_seqlen_q=metadata.max_seqlen_q,
                max_seqlen_k=metadata.max_seqlen_k,
                softmax_scale=layer.scale,
                causal=True,
                block_table=metadata.page_table,
                **extra,
            )
        if self.kernel.takes_max_seqlen_q:
            extra["max_seqlen_q"] = metadata.max_seqlen_q
        out = self.kernel.varlen(
            query,
            key_cache,
            value_cache,
            cu_seqlens_q=metadata.cu_seqlens_q,
            seqused_k=metadata.seqused_k,
            page_table=metadata.page_table,
            softmax_scale=layer.scale,
            causal=True,
            **extra,
        )
        return out[0] if isinstance(out, tuple) else out  # (out, lse); lse is None unless return_lse


def _layer_arguments(layer: LayerAttention) -> dict:
    """flash-attn's keyword arguments for the layer's window and soft-cap (both generations name them alike), and
    its sinks (flash-attn 4's `learnable_sink`, which it takes in bfloat16 only: the dtype flash serves anyway)."""
    arguments: dict = {}
    if layer.sliding_window is not None:
        arguments["window_size"] = (layer.sliding_window - 1, 0)
    if layer.softcap is not None:
        arguments["softcap"] = layer.softcap
    if layer.sinks is not None:
        arguments["learnable_sink"] = layer.sinks.to(torch.bfloat16)
    return arguments
