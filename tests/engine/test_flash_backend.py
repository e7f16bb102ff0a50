"""The flash backend on CPU, with flash-attn mocked at its API boundary.

Fake `flash_attn` / `flash_attn.cute` modules go into sys.modules. Their `flash_attn_varlen_func`
have the real signatures (flash_attn/flash_attn_interface.py of flash-attn 2.8, flash_attn/cute/
interface.py of flash-attn 4), record the arguments of each call, check them the way the real
functions do (int32 metadata, a page table with a contiguous last dimension, the cache's shape) and
compute what the kernel computes, in float64: causal attention aligned to the bottom right of each
request's KV, through the page table. So a wrong argument shows up either in the recorded call or in
the output against the float64 reference. Nothing here runs flash-attn itself: tests/gpu does.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import re
import sys
import types
from typing import Any, Callable, Optional

import pytest
import torch

import engine.attention.backend as backend_module
import engine.attention.probe as probe_module
from engine.attention.layer_attention import LayerAttention
from engine.attention import get_attention_backend
from engine.attention.backend import cuda_auto_choice
from engine.attention.attention_shape import AttentionShape
from engine.attention.flash_backend import FlashAttentionBackend, FlashKernel, find_flash_kernel, flash_versions
from engine.attention.probe import probe_backend
from engine.attention.step_metadata import step_metadata_for
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.kv_cache import KVCacheSpec
from tests.engine.paged_steps import random_paged_step, reference_attention, slot_of

CUDA = torch.device("cuda")  # only ever named here: nothing is allocated on it
HOPPER, AMPERE = (9, 0), (8, 0)
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16
MIXED = [(37, 1), (5, 1), (50, 20), (9, 9)]  # decodes at 37 and 5; a chunk over a 30-token prefix; a prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------ fakes of the kernels


def paged_varlen(q, k_cache, v_cache, cu_seqlens_q, kv_lens, page_table, scale: float) -> torch.Tensor:
    """What both kernels compute: query i of request b (q_b queries, k_b keys) sees keys 0 .. k_b - q_b + i."""
    assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1, "page table: int32, last dim contiguous"
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    assert v_cache.shape == k_cache.shape and page_table.shape[0] == cu_seqlens_q.shape[0] - 1
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = cu_seqlens_q.tolist()
    for b, kv_len in enumerate(kv_lens.tolist()):
        rows = slice(starts[b], starts[b + 1])
        query_len = starts[b + 1] - starts[b]
        blocks = page_table[b, : -(-kv_len // block_size)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:kv_len].double()
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:kv_len].double()
        group = q.shape[1] // kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,thd->hqt", q[rows].double(), k) * scale
        visible = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - query_len, kv_len)[:, None]
        out[rows] = torch.einsum("hqt,thd->qhd", torch.softmax(scores.masked_fill(~visible, float("-inf")), -1), v)
    return out.to(q.dtype)


def check_int32_vector(tensor: torch.Tensor, length: int, name: str) -> None:
    assert tensor.dtype == torch.int32 and tensor.shape == (length,) and tensor.stride(0) == 1, name


class FakeFlashAttn4:
    """flash_attn.cute.flash_attn_varlen_func (flash-attn 4): returns (out, lse)."""

    def __init__(self):
        self.calls: list[dict[str, Any]] = []

    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        qv=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        min_seqlen_k=None,
        seqused_q=None,
        seqused_k=None,
        gather_kv_indices=None,
        page_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(None, None),
        learnable_sink=None,
        softcap=0.0,
        num_splits=1,
        pack_gqa=None,
        deterministic=False,
        score_mod=None,
        score_mod_bwd=None,
        mask_mod=None,
        block_sparse_tensors=None,
        aux_tensors=None,
        aux_scalars=None,
        return_lse=False,
        scheduler_metadata=None,
        seqlen_k_per_split=None,
        disable_scheduler_metadata=False,
    ):
        self.calls.append(
            dict(
                q=q,
                k=k,
                v=v,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                seqused_k=seqused_k,
                page_table=page_table,
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window_size,
                return_lse=return_lse,
            )
        )
        batch = cu_seqlens_q.shape[0] - 1
        assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
        check_int32_vector(cu_seqlens_q, batch + 1, "cu_seqlens_q")
        check_int32_vector(seqused_k, batch, "seqused_k")
        return paged_varlen(q, k, v, cu_seqlens_q, seqused_k, page_table, softmax_scale), None


class FakeFlashAttn4WithoutMaxSeqlenQ:
    """An early flash-attn 4 release (late 2025): no max_seqlen_q argument."""

    def __init__(self):
        self.calls: list[dict[str, Any]] = []

    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        seqused_q=None,
        seqused_k=None,
        page_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(None, None),
        learnable_sink=None,
        softcap=0.0,
        num_splits=1,
        pack_gqa=None,
    ):
        self.calls.append(dict(cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, page_table=page_table))
        return paged_varlen(q, k, v, cu_seqlens_q, seqused_k, page_table, softmax_scale), None


class FakeFlashAttn2:
    """flash_attn.flash_attn_varlen_func (flash-attn 2.8): returns out; paged KV through block_table."""

    def __init__(self, with_block_table: bool = True):
        self.calls: list[dict[str, Any]] = []
        if not with_block_table:  # flash-attn < 2.5
            self.flash_attn_varlen_func = self._without_block_table

    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        self.calls.append(
            dict(
                q=q,
                k=k,
                v=v,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                dropout_p=dropout_p,
                softmax_scale=softmax_scale,
                causal=causal,
                block_table=block_table,
            )
        )
        if k.shape[1] % 256:
            raise RuntimeError("Paged KV cache block size must be divisible by 256")
        batch = cu_seqlens_q.shape[0] - 1
        check_int32_vector(cu_seqlens_q, batch + 1, "cu_seqlens_q")
        check_int32_vector(cu_seqlens_k, batch + 1, "cu_seqlens_k")
        return paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k.diff(), block_table, softmax_scale)

    @staticmethod
    def _without_block_table(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        return_attn_probs=False,
    ):
        raise AssertionError("never called")


def install(
    monkeypatch,
    *,
    fa2: Optional[FakeFlashAttn2] = None,
    fa4: Optional[object] = None,
    capability: tuple[int, int] = HOPPER,
    broken: Optional[Exception] = None,
) -> None:
    """Put fake flash-attn modules (or their absence) into sys.modules and fake the GPU's compute capability."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if broken is not None:  # installed, but its CUDA libraries do not load
        monkeypatch.setattr("importlib.import_module", _import_raising(broken))
        return
    if fa2 is None and fa4 is None:
        monkeypatch.setitem(sys.modules, "flash_attn", None)
        monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
        return
    package = types.ModuleType("flash_attn")  # flash-attn 4 alone installs a namespace package: no functions
    if fa2 is not None:
        package.__version__ = "2.8.3"
        package.flash_attn_varlen_func = fa2.flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    if fa4 is None:
        monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    else:
        cute = types.ModuleType("flash_attn.cute")
        cute.__version__ = "4.0.0"
        cute.flash_attn_varlen_func = fa4.flash_attn_varlen_func
        monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)


def _import_raising(error: Exception) -> Callable:
    import importlib

    real = importlib.import_module

    def import_module(name, package=None):
        if name.split(".")[0] == "flash_attn":
            raise error
        return real(name, package)

    return import_module


# ------------------------------------------------------------------ what the kernel is given


def flash_backend(monkeypatch, block_size: int, **fakes) -> FlashAttentionBackend:
    install(monkeypatch, **fakes)
    backend = get_attention_backend("flash", CUDA, torch.bfloat16, block_size=block_size)
    assert isinstance(backend, FlashAttentionBackend)
    return backend


def run_step(backend, block_size: int, shapes=MIXED, num_decodes: int = 2):
    """A mixed step (decodes, a chunk over a cached prefix, a prompt) on CPU in float32: the backend's output
    and the float64 reference."""
    step = random_paged_step(
        shapes,
        num_decodes,
        block_size=block_size,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_blocks=max(40, 2 * -(-sum(s for s, _ in shapes) // block_size)),
    )
    spec = KVCacheSpec(1, block_size, KV_HEADS, HEAD_DIM, torch.float32)
    metadata = backend.build_metadata(step.metadata, spec)
    backend.write_kv(step.key, step.value, step.key_cache, step.value_cache, metadata)
    scale = HEAD_DIM**-0.5
    out = backend.attend(
        step.query, step.key, step.value, step.key_cache, step.value_cache, metadata, LayerAttention(scale)
    )
    return step, out, reference_attention(step, scale)


def test_flash_attn_4_gets_the_step_as_its_paged_varlen_call_reads_it(monkeypatch):
    fa4 = FakeFlashAttn4()
    backend = flash_backend(monkeypatch, 16, fa4=fa4)
    assert backend.name == "flash (flash-attn 4)"
    step, out, expected = run_step(backend, 16)
    (call,) = fa4.calls  # one call for decodes and prefill chunks alike
    assert call["q"] is step.query and call["k"] is step.key_cache and call["v"] is step.value_cache
    assert call["cu_seqlens_q"].tolist() == [0, 1, 2, 22, 31]
    assert call["seqused_k"].tolist() == [37, 5, 50, 9] and call["seqused_k"].dtype == torch.int32
    assert call["page_table"].dtype == torch.int32 and call["page_table"].stride(-1) == 1
    for row, request in enumerate(step.requests):
        assert call["page_table"][row, : len(request.blocks)].tolist() == request.blocks
    assert call["max_seqlen_q"] == 20
    assert call["causal"] is True and call["softmax_scale"] == HEAD_DIM**-0.5
    assert call["cu_seqlens_k"] is None and call["max_seqlen_k"] is None and call["return_lse"] is False
    assert call["window_size"] == (None, None)
    assert out.shape == step.query.shape and out.dtype == step.query.dtype  # out of (out, lse)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_flash_attn_4_without_max_seqlen_q_is_not_given_one(monkeypatch):
    fa4 = FakeFlashAttn4WithoutMaxSeqlenQ()
    step, out, expected = run_step(flash_backend(monkeypatch, 16, fa4=fa4), 16)
    assert len(fa4.calls) == 1
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_flash_attn_2_gets_cumulative_kv_lengths_and_the_block_table(monkeypatch):
    fa2 = FakeFlashAttn2()
    backend = flash_backend(monkeypatch, 256, fa2=fa2, capability=AMPERE)
    assert backend.name == "flash (flash-attn 2)"
    shapes = [(300, 1), (5, 1), (700, 200), (9, 9)]  # the chunk continues a 500-token prefix over 3 blocks
    step, out, expected = run_step(backend, 256, shapes)
    (call,) = fa2.calls
    assert call["q"] is step.query and call["k"] is step.key_cache and call["v"] is step.value_cache
    assert call["cu_seqlens_q"].tolist() == [0, 1, 2, 202, 211] and call["cu_seqlens_q"].dtype == torch.int32
    assert call["cu_seqlens_k"].tolist() == [0, 300, 305, 1005, 1014] and call["cu_seqlens_k"].dtype == torch.int32
    assert call["max_seqlen_q"] == 200 and call["max_seqlen_k"] == 700
    assert call["block_table"].dtype == torch.int32 and call["block_table"].stride(-1) == 1
    assert call["block_table"][2, :3].tolist() == step.requests[2].blocks
    assert call["causal"] is True and call["softmax_scale"] == HEAD_DIM**-0.5 and call["dropout_p"] == 0.0
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_flash_attn_2_cumulative_lengths_follow_each_step(monkeypatch):
    """The cumulative KV lengths live in a buffer kept across steps: a smaller step after a larger one, and a
    larger one after that, each get their own."""
    backend = flash_backend(monkeypatch, 256, fa2=FakeFlashAttn2())
    spec = KVCacheSpec(1, 256, KV_HEADS, HEAD_DIM, torch.bfloat16)
    for lens in ([7, 300, 12], [4], list(range(1, 100))):
        step = step_metadata_for(
            [(n, 1, [0, 1]) for n in lens], torch.zeros(len(lens), dtype=torch.int64), len(lens), torch.device("cpu")
        )
        cumulative = backend.build_metadata(step, spec).cu_seqlens_k
        assert cumulative.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]


def test_write_kv_writes_each_new_token_at_its_slot_and_nothing_else(monkeypatch):
    backend = flash_backend(monkeypatch, 16, fa4=FakeFlashAttn4())
    step = random_paged_step(
        MIXED, 2, block_size=16, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_blocks=40
    )
    expected_k, expected_v = step.key_cache.clone(), step.value_cache.clone()  # untouched but for the new slots
    for r in step.requests:
        for pos in range(r.seq_len - r.query_len, r.seq_len):
            expected_k.view(-1, KV_HEADS, HEAD_DIM)[slot_of(r.blocks, pos, 16)] = r.keys[pos]
            expected_v.view(-1, KV_HEADS, HEAD_DIM)[slot_of(r.blocks, pos, 16)] = r.values[pos]
    assert not torch.equal(expected_k, step.key_cache)
    metadata = backend.build_metadata(step.metadata, KVCacheSpec(1, 16, KV_HEADS, HEAD_DIM, torch.float32))
    assert metadata.slot_mapping is step.metadata.slot_mapping
    backend.write_kv(step.key, step.value, step.key_cache, step.value_cache, metadata)
    assert torch.equal(step.key_cache, expected_k) and torch.equal(step.value_cache, expected_v)


def test_flash_writes_what_the_torch_backend_writes(monkeypatch):
    flash = flash_backend(monkeypatch, 16, fa4=FakeFlashAttn4())
    caches = []
    for backend in (flash, TorchAttentionBackend()):
        step = random_paged_step(
            MIXED, 2, block_size=16, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_blocks=40
        )
        metadata = backend.build_metadata(step.metadata, KVCacheSpec(1, 16, KV_HEADS, HEAD_DIM, torch.float32))
        backend.write_kv(step.key, step.value, step.key_cache, step.value_cache, metadata)
        caches.append((step.key_cache, step.value_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


# ------------------------------------------------------------------ selection


@pytest.fixture(autouse=True)
def no_triton(monkeypatch):
    """These tests choose between flash and torch: Triton (installed here) is taken out of `auto`'s order."""
    monkeypatch.setattr(backend_module, "_triton_available", lambda device, dtype: False)


@pytest.mark.parametrize(
    "flash, triton, expected",
    [
        (True, True, "flash"),
        (True, False, "flash"),
        (False, True, "triton"),
        (False, False, "torch"),
    ],
)
def test_auto_order_on_cuda(flash, triton, expected):
    assert cuda_auto_choice(flash_available=flash, triton_available=triton) == expected


@pytest.mark.parametrize(
    "installed, capability, block_size, expected",
    [
        ({"fa4"}, HOPPER, 16, "flash (flash-attn 4)"),
        ({"fa4"}, HOPPER, 1, "flash (flash-attn 4)"),
        ({"fa4", "fa2"}, HOPPER, 16, "flash (flash-attn 4)"),
        ({"fa4", "fa2"}, HOPPER, 256, "flash (flash-attn 4)"),  # flash-attn 4 first where it runs
        ({"fa4", "fa2"}, AMPERE, 256, "flash (flash-attn 2)"),
        ({"fa4", "fa2"}, AMPERE, 16, "torch"),
        ({"fa4"}, AMPERE, 256, "torch"),
        ({"fa2"}, HOPPER, 512, "flash (flash-attn 2)"),
        ({"fa2"}, HOPPER, 16, "torch"),  # never flash-attn 2 below its block multiple
        ({"fa2"}, HOPPER, 128, "torch"),
        ({"fa2"}, AMPERE, None, "torch"),  # block size not known
        (set(), HOPPER, 256, "torch"),
    ],
)
def test_auto_on_cuda_picks_flash_when_it_imports_and_fits(
    monkeypatch, caplog, installed, capability, block_size, expected
):
    install(
        monkeypatch,
        fa2=FakeFlashAttn2() if "fa2" in installed else None,
        fa4=FakeFlashAttn4() if "fa4" in installed else None,
        capability=capability,
    )
    with caplog.at_level(logging.INFO, logger="engine.attention.backend"):
        backend = get_attention_backend("auto", CUDA, torch.bfloat16, block_size=block_size)
    assert backend.name == expected
    (record,) = [r for r in caplog.records if "attention backend auto on CUDA" in r.getMessage()]
    assert record.getMessage().startswith(f"attention backend auto on CUDA: {expected.split()[0]} (")


def test_auto_on_cuda_logs_why_flash_attn_2_was_passed_over(monkeypatch, caplog):
    install(monkeypatch, fa2=FakeFlashAttn2(), capability=AMPERE)
    with caplog.at_level(logging.INFO, logger="engine.attention.backend"):
        assert get_attention_backend("auto", CUDA, torch.float16, block_size=16).name == "torch"
    assert "multiple of 256, not 16" in caplog.text and "compute capability 9.0" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_auto_on_cuda_in_full_precision_is_torch_without_triton(monkeypatch, dtype):
    install(monkeypatch, fa4=FakeFlashAttn4(), fa2=FakeFlashAttn2())
    assert get_attention_backend("auto", CUDA, dtype, block_size=256).name == "torch"


@pytest.mark.parametrize(
    "fakes, block_size, message",
    [
        (
            {"fa2": "fa2"},
            16,
            r"flash-attn 2 2\.8\.3: its paged kernels need a KV block size that is a multiple of 256, "
            r"not 16.*--block-size 256",
        ),
        (
            {"fa2": "fa2", "capability": AMPERE},
            128,
            r"compute capability 9\.0 or newer \(Hopper\+\), this GPU has 8\.0.*"
            r"multiple of 256, not 128",
        ),
        (
            {"fa4": "fa4", "capability": AMPERE},
            16,
            r"compute capability 9\.0.*flash-attn 2: flash_attn has no "
            r"flash_attn_varlen_func \(not installed\).*Install flash-attn-4",
        ),
        (
            {},
            256,
            r"flash-attn 4: not installed \(no module flash_attn\.cute\); flash-attn 2: not installed \(no module "
            r"flash_attn\)\. Install flash-attn-4",
        ),
        ({"fa2": "old"}, 256, r"has no block_table \(paged KV came in 2\.5\); upgrade flash-attn"),
        (
            {"broken": "no-dependency"},
            16,
            r"flash-attn 4: flash_attn\.cute does not import \(ModuleNotFoundError: "
            r"No module named 'cutlass'\)",
        ),
        (
            {"broken": "broken"},
            256,
            r"flash_attn\.cute does not import \(OSError: libcudart\.so\.13.*flash_attn does "
            r"not import \(OSError",
        ),
    ],
)
def test_naming_flash_where_it_cannot_run_says_why_and_what_to_do(monkeypatch, fakes, block_size, message):
    kinds = {
        "fa2": lambda: FakeFlashAttn2(),
        "old": lambda: FakeFlashAttn2(with_block_table=False),
        "fa4": lambda: FakeFlashAttn4(),
        "broken": lambda: OSError("libcudart.so.13: cannot open shared object"),
        "no-dependency": lambda: ModuleNotFoundError("No module named 'cutlass'", name="cutlass"),
    }
    arguments = {key: kinds[value]() if isinstance(value, str) else value for key, value in fakes.items()}
    install(monkeypatch, **arguments)
    with pytest.raises(ValueError, match=r"^attention backend 'flash' cannot run here: .*" + message):
        get_attention_backend("flash", CUDA, torch.bfloat16, block_size=block_size)


@pytest.mark.parametrize(
    "device, dtype, message",
    [
        (torch.device("cpu"), torch.bfloat16, r"flash-attn runs on CUDA, not cpu\. Use auto, cpu or torch off CUDA"),
        (CUDA, torch.float32, r"flash-attn runs float16/bfloat16, not float32\. Set --dtype bfloat16"),
    ],
)
def test_naming_flash_off_its_device_or_dtype_says_so(monkeypatch, device, dtype, message):
    install(monkeypatch, fa4=FakeFlashAttn4(), fa2=FakeFlashAttn2())
    with pytest.raises(ValueError, match=message):
        get_attention_backend("flash", device, dtype, block_size=256)


def test_the_kernel_is_chosen_once_at_construction(monkeypatch):
    """The import check runs when the backend is chosen; the steps call the function found then."""
    fa4 = FakeFlashAttn4()
    backend = flash_backend(monkeypatch, 16, fa4=fa4)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    run_step(backend, 16)
    assert len(fa4.calls) == 1


def test_find_flash_kernel_reports_the_version(monkeypatch):
    install(monkeypatch, fa4=FakeFlashAttn4())
    search = find_flash_kernel(CUDA, torch.bfloat16, 16)
    assert isinstance(search.kernel, FlashKernel) and search.kernel.major == 4 and search.kernel.label == "flash-attn 4"
    assert search.summary.startswith("flash-attn 4 ") and "any block size" in search.summary


def test_auto_on_cuda_picks_triton_when_flash_cannot_serve(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(backend_module, "_triton_available", lambda device, dtype: True)
    install(monkeypatch, fa2=FakeFlashAttn2())  # flash-attn 2 only, at a block size it cannot page
    assert get_attention_backend("auto", CUDA, torch.bfloat16, block_size=16).name == "triton"


# ------------------------------------------------------------------ the start-up probe

SHAPE = AttentionShape(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


class FakeFlashAttn4PagingRefused(FakeFlashAttn4):
    """flash-attn 4 before 4.0.0b5 on SM 9.0 (and SM 12.x still): the signature takes a page table, the
    kernel asserts on one."""

    @functools.wraps(FakeFlashAttn4.flash_attn_varlen_func)  # the real signature, which the search inspects
    def flash_attn_varlen_func(self, q, k, v, *args, page_table=None, **kwargs):
        self.calls.append(dict(q=q, page_table=page_table))
        assert page_table is None, "paged KV not supported on SM 9.0"
        raise AssertionError("never reached")


class FakeFlashAttn4Wrong(FakeFlashAttn4):
    """A kernel that runs but answers wrongly (here: ignores the scale)."""

    @functools.wraps(FakeFlashAttn4.flash_attn_varlen_func)
    def flash_attn_varlen_func(self, q, k, v, *args, softmax_scale=None, **kwargs):
        return super().flash_attn_varlen_func(q, k, v, *args, softmax_scale=1.0, **kwargs)


@pytest.fixture
def probe_on_cpu(monkeypatch):
    """The probe allocates on the device it is given: here the CPU stands in for the GPU."""
    real = probe_module.probe_step
    monkeypatch.setattr(probe_module, "probe_step", lambda *args: real(*args[:-1], torch.device("cpu")))


@pytest.mark.usefixtures("probe_on_cpu")
def test_auto_probes_the_exact_configuration_before_choosing_flash(monkeypatch, caplog):
    fa4 = FakeFlashAttn4()
    install(monkeypatch, fa4=fa4)
    with caplog.at_level(logging.INFO, logger="engine.attention.backend"):
        backend = get_attention_backend("auto", CUDA, torch.bfloat16, block_size=16, shape=SHAPE)
    assert backend.name == "flash (flash-attn 4)"
    mixed, decodes = fa4.calls  # the probe: paged calls of the model's heads, head dim and dtype
    assert mixed["q"].shape == (204, HEADS, HEAD_DIM) and mixed["q"].dtype == torch.bfloat16
    assert mixed["k"].shape[1:] == (16, KV_HEADS, HEAD_DIM) and mixed["page_table"].shape == (3, 17)
    assert mixed["seqused_k"].tolist() == [18, 260, 3] and mixed["cu_seqlens_q"].tolist() == [0, 1, 201, 204]
    assert mixed["max_seqlen_q"] == 200 and decodes["max_seqlen_q"] == 1
    assert decodes["seqused_k"].tolist() == [300, 37, 1] and decodes["cu_seqlens_q"].tolist() == [0, 1, 2, 3]
    assert "its probe of 6/2 heads of dim 16, block size 16 passed" in caplog.text


@pytest.mark.usefixtures("probe_on_cpu")
@pytest.mark.parametrize(
    "fake, reason",
    [
        (
            FakeFlashAttn4PagingRefused,
            r"its probe mixed step failed \(AssertionError: paged KV not supported on SM "
            r"9\.0\)",
        ),
        (
            FakeFlashAttn4Wrong,
            r"its probe mixed step gave wrong results \(max abs error .* against a float32 "
            r"reference\)",
        ),
    ],
)
def test_auto_falls_back_to_triton_when_the_flash_probe_fails(monkeypatch, caplog, fake, reason):
    pytest.importorskip("triton")
    monkeypatch.setattr(backend_module, "_triton_available", lambda device, dtype: True)
    install(monkeypatch, fa4=fake())
    with caplog.at_level(logging.INFO, logger="engine.attention.backend"):
        backend = get_attention_backend("auto", CUDA, torch.bfloat16, block_size=16, shape=SHAPE)
    assert backend.name == "triton"
    (line,) = [r.getMessage() for r in caplog.records if "attention backend auto on CUDA" in r.getMessage()]
    assert line.startswith("attention backend auto on CUDA: triton (flash-attn 4 4.0.0: ")
    assert re.search(reason + r" with bfloat16, 6/2 heads of dim 16, block size 16", line)


@pytest.mark.usefixtures("probe_on_cpu")
def test_a_failed_flash_attn_4_probe_leaves_flash_attn_2_its_turn(monkeypatch):
    fa2 = FakeFlashAttn2()
    install(monkeypatch, fa4=FakeFlashAttn4PagingRefused(), fa2=fa2)
    backend = get_attention_backend("auto", CUDA, torch.float16, block_size=256, shape=SHAPE)
    assert backend.name == "flash (flash-attn 2)" and len(fa2.calls) == 2  # its own probe


@pytest.mark.usefixtures("probe_on_cpu")
def test_naming_flash_whose_probe_fails_says_why(monkeypatch):
    install(monkeypatch, fa4=FakeFlashAttn4PagingRefused())
    with pytest.raises(
        ValueError,
        match=r"attention backend 'flash' cannot run here: flash-attn 4 4\.0\.0: its probe "
        r"mixed step failed \(AssertionError: paged KV not supported on SM 9\.0\)",
    ):
        get_attention_backend("flash", CUDA, torch.bfloat16, block_size=16, shape=SHAPE)


def test_the_probe_passes_the_torch_backend_and_refuses_a_wrong_one():
    """The probe's own reference, checked on the reference backend (fp32 and bf16) and on a broken one."""
    for dtype in (torch.float32, torch.bfloat16):
        assert probe_backend(TorchAttentionBackend(), SHAPE, 16, dtype, torch.device("cpu")) is None

    class NoCausalMask(TorchAttentionBackend):
        def attend(self, query, key, value, key_cache, value_cache, metadata, layer):
            return super().attend(query, key, value, key_cache, value_cache, metadata, layer).flip(0)

    failure = probe_backend(NoCausalMask(), SHAPE, 16, torch.float32, torch.device("cpu"))
    assert failure is not None and failure.startswith("its probe mixed step gave wrong results")


@pytest.mark.parametrize("block_size", [1, 2, 16, 256])
def test_the_probe_runs_at_every_block_size(block_size):
    assert probe_backend(TorchAttentionBackend(), SHAPE, block_size, torch.float32, torch.device("cpu")) is None


def test_find_flash_kernel_searches_the_generations_asked_for(monkeypatch):
    install(monkeypatch, fa4=FakeFlashAttn4(), fa2=FakeFlashAttn2())
    assert find_flash_kernel(CUDA, torch.bfloat16, 256, generations=(2,)).kernel.major == 2
    assert find_flash_kernel(CUDA, torch.bfloat16, 256, generations=(4,)).kernel.major == 4
    assert find_flash_kernel(CUDA, torch.bfloat16, 16, generations=(2,)).kernel is None


def test_flash_versions_come_from_the_distributions(monkeypatch):
    installed = {"flash-attn-4": "4.0.0b20"}

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert flash_versions() == {"flash-attn": None, "flash-attn-4": "4.0.0b20"}


def test_flash_attn_2_is_passed_over_for_a_head_dim_it_would_pad(monkeypatch):
    install(monkeypatch, fa2=FakeFlashAttn2(), capability=AMPERE)
    search = find_flash_kernel(CUDA, torch.bfloat16, 256, AttentionShape(4, 2, 36))
    assert search.kernel is None and "head dim 36 is not a multiple of 8" in search.summary


@pytest.mark.parametrize("kv_cache_dtype", [torch.float8_e4m3fn, torch.float16])
def test_auto_on_cuda_passes_flash_over_for_a_cache_it_cannot_read(monkeypatch, caplog, kv_cache_dtype):
    """flash-attn reads K/V in the query's dtype only: with another --kv-cache-dtype, auto takes the triton
    backend (fp8 included) or torch, never a flash backend that start-up would then refuse; a cache in the
    model's dtype keeps flash."""
    pytest.importorskip("triton")
    install(monkeypatch, fa4=FakeFlashAttn4())
    for same in (None, torch.bfloat16):
        backend = get_attention_backend("auto", CUDA, torch.bfloat16, block_size=16, kv_cache_dtype=same)
        assert backend.name == "flash (flash-attn 4)"
    with caplog.at_level(logging.INFO, logger="engine.attention.backend"):
        backend = get_attention_backend("auto", CUDA, torch.bfloat16, block_size=16, kv_cache_dtype=kv_cache_dtype)
    assert backend.name == "torch"  # Triton taken out of the order by this file's fixture
    monkeypatch.setattr(backend_module, "_triton_available", lambda device, dtype: True)
    backend = get_attention_backend("auto", CUDA, torch.bfloat16, block_size=16, kv_cache_dtype=kv_cache_dtype)
    assert backend.name == "triton" and kv_cache_dtype in backend.kv_cache_dtypes(torch.bfloat16)
    name = "fp8" if kv_cache_dtype == torch.float8_e4m3fn else "float16"  # as the flag names it
    assert f"attention backend auto on CUDA: torch (flash-attn does not read a {name} KV cache)" in caplog.text


def test_auto_on_cuda_passes_flash_over_for_a_layer_feature_it_lacks(monkeypatch, caplog):
    """GPT-OSS's layers have attention sinks, which flash-attn 2's varlen function does not take: auto must choose
    a backend that computes them (triton, else torch), not flash-attn 2, which start-up's check then refuses
    with "choose another --attention-backend" although the user chose none. flash-attn 4 takes sinks."""
    pytest.importorskip("triton")
    from engine.attention.layer_attention import SINKS, SLIDING_WINDOW, LayerAttention, check_backend_serves
    from engine.platform import choose_numerics

    install(monkeypatch, fa2=FakeFlashAttn2(), capability=AMPERE)
    layers = [LayerAttention(0.1, sliding_window=128, sinks=torch.zeros(HEADS)), LayerAttention(0.1)]
    assert get_attention_backend("auto", CUDA, torch.bfloat16, block_size=256).name == "flash (flash-attn 2)"
    with caplog.at_level(logging.INFO, logger="engine.attention.backend"):
        backend = get_attention_backend(
            "auto", CUDA, torch.bfloat16, block_size=256, needs=frozenset({SINKS, SLIDING_WINDOW})
        )
    assert backend.name == "torch"  # Triton taken out of the order by this file's fixture
    assert "flash-attn 2 2.8.3: its varlen function does not compute attention sinks" in caplog.text
    monkeypatch.setattr(backend_module, "_triton_available", lambda device, dtype: True)
    numerics = choose_numerics("auto", CUDA, torch.bfloat16, block_size=256, shape=SHAPE, needs=frozenset({SINKS}))
    assert numerics.backend.name == "triton"
    check_backend_serves(numerics.backend, layers, "GptOssForCausalLM")
    install(monkeypatch, fa4=FakeFlashAttn4(), fa2=FakeFlashAttn2())  # flash-attn 4 names learnable_sink
    backend = get_attention_backend("auto", CUDA, torch.bfloat16, block_size=16, needs=frozenset({SINKS}))
    assert backend.name == "flash (flash-attn 4)"
    check_backend_serves(backend, layers, "GptOssForCausalLM")
