"""Sliding windows and soft-capped scores (engine/attention/layer_attention.py) in every CPU-testable backend,
against a float64 reference: torch, cpu (the native decode kernel, its portable and AVX-512 paths, split or
not), cpu-batch-invariant; flash through fakes of flash-attn that record what they are given; and the
start-up refusal of a backend that cannot compute a layer's feature. (Triton: tests/engine/triton.)"""

from __future__ import annotations

import pytest
import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.flash_backend import FlashAttentionBackend, FlashKernel
from engine.attention.invariant_backend import BatchInvariantCpuBackend
from engine.attention.kv_cache import KVCacheSpec
from engine.attention.layer_attention import SLIDING_WINDOW, SOFTCAP, LayerAttention, check_backend_serves
from engine.attention.torch_backend import TorchAttentionBackend
from tests.engine.paged_steps import random_paged_step, reference_attention

MIXED = [(37, 1), (5, 1), (1, 1), (50, 20), (9, 9), (30, 1)]  # decodes; a chunk over a prefix; a prompt; a row
LAYERS = [
    LayerAttention(0.25, sliding_window=7),
    LayerAttention(0.25, softcap=2.0),
    LayerAttention(0.3, sliding_window=16, softcap=1.5),
    LayerAttention(0.25, sliding_window=1),
    LayerAttention(0.25, sliding_window=500),
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=["torch", "cpu", "cpu-batch-invariant"])
def backend(request, cpu_kernels):
    return {
        "torch": TorchAttentionBackend,
        "cpu": lambda: CpuAttentionBackend(cpu_kernels),
        "cpu-batch-invariant": lambda: BatchInvariantCpuBackend(cpu_kernels),
    }[request.param]()


def run_step(backend, step, layer: LayerAttention) -> torch.Tensor:
    _, block_size, kv_heads, head_dim = step.key_cache.shape
    metadata = backend.build_metadata(
        step.metadata, KVCacheSpec(1, block_size, kv_heads, head_dim, step.key_cache.dtype)
    )
    backend.write_kv(step.key, step.value, step.key_cache, step.value_cache, metadata)
    return backend.attend(step.query, step.key, step.value, step.key_cache, step.value_cache, metadata, layer)


@pytest.mark.parametrize("head_dim", [16, 64])  # the native kernel's portable loops, and its AVX-512 path
@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: f"w{layer.sliding_window}-cap{layer.softcap}")
def test_backends_honour_windows_and_softcaps(backend, layer, head_dim):
    step = random_paged_step(
        MIXED, 3, block_size=4, num_heads=4, num_kv_heads=2, head_dim=head_dim, num_blocks=64, seed=head_dim
    )
    got = run_step(backend, step, layer)
    expected = reference_attention(step, layer.scale, layer.sliding_window, layer.softcap)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("window", [None, 300, 700])
def test_native_decode_splits_a_long_window(cpu_kernels, head_dim, window):
    """Long sequences split across threads (split=True, 2 threads): each part starts inside the window."""
    step = random_paged_step(
        [(900, 1), (520, 1)], 2, block_size=16, num_heads=4, num_kv_heads=2, head_dim=head_dim, num_blocks=96, seed=3
    )
    metadata = CpuAttentionBackend(cpu_kernels).build_metadata(
        step.metadata, KVCacheSpec(1, 16, 2, head_dim, torch.float32)
    )
    CpuAttentionBackend(cpu_kernels).write_kv(step.key, step.value, step.key_cache, step.value_cache, metadata)
    expected = reference_attention(step, 0.2, window, 3.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for split in (True, False):
            got = cpu_kernels.paged_decode(
                step.query,
                step.key_cache,
                step.value_cache,
                metadata.decode_block_tables,
                metadata.decode_context_lens,
                0.2,
                split,
                window=window,
                softcap=3.0,
            )
            torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)
    finally:
        torch.set_num_threads(threads)


def test_native_decode_in_bfloat16(cpu_kernels):
    step = random_paged_step(
        [(70, 1), (33, 1)],
        2,
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        num_blocks=16,
        dtype=torch.bfloat16,
        seed=5,
    )
    layer = LayerAttention(0.125, sliding_window=20, softcap=2.0)
    got = run_step(CpuAttentionBackend(cpu_kernels), step, layer)
    expected = reference_attention(step, layer.scale, layer.sliding_window, layer.softcap)
    torch.testing.assert_close(got.double(), expected, atol=3e-2, rtol=3e-2)


class RecordingVarlen:
    """A flash-attn varlen function of either generation's signature: records its keyword arguments."""

    def __init__(self, *, window: bool = True, softcap: bool = True):
        self.calls: list[dict] = []
        self.window, self.softcap = window, softcap

    def __call__(self, q, k, v, **kwargs):
        assert ("window_size" not in kwargs or self.window) and ("softcap" not in kwargs or self.softcap)
        self.calls.append(kwargs)
        return torch.zeros_like(q)


@pytest.mark.parametrize("major", [2, 4])
def test_flash_passes_the_layer_to_flash_attn(major):
    varlen = RecordingVarlen()
    backend = FlashAttentionBackend(FlashKernel(major, "test", varlen))
    assert set(backend.attention_features) == {SLIDING_WINDOW, SOFTCAP}
    step = random_paged_step(
        [(9, 1), (12, 5)], 1, block_size=4, num_heads=4, num_kv_heads=2, head_dim=16, num_blocks=16
    )
    for layer in (LayerAttention(0.5), LayerAttention(0.5, sliding_window=4096, softcap=30.0)):
        run_step(backend, step, layer)
    plain, windowed = varlen.calls
    assert "window_size" not in plain and "softcap" not in plain and plain["softmax_scale"] == 0.5
    assert windowed["window_size"] == (4095, 0) and windowed["softcap"] == 30.0 and windowed["causal"]


def test_a_backend_without_a_feature_is_refused_at_start_up():
    old_release = FlashAttentionBackend(
        FlashKernel(2, "2.2", RecordingVarlen(window=False, softcap=False), takes_window=False, takes_softcap=False)
    )
    layers = [LayerAttention(0.1, sliding_window=8, softcap=50.0), LayerAttention(0.1, softcap=50.0)]
    with pytest.raises(
        ValueError,
        match=r"'flash \(flash-attn 2\)' cannot serve Gemma2ForCausalLM: it does not "
        r"implement attention soft-capping or sliding window",
    ):
        check_backend_serves(old_release, layers, "Gemma2ForCausalLM")
    check_backend_serves(old_release, [LayerAttention(0.1)], "LlamaForCausalLM")
    check_backend_serves(TorchAttentionBackend(), layers, "Gemma2ForCausalLM")
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        LayerAttention(0.1, sliding_window=0)
