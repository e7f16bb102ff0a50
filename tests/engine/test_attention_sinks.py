"""Attention sinks (GPT-OSS: a learned logit per head that joins the softmax's denominator and has no value) in
every CPU-testable backend against the float64 reference: torch, cpu (the native decode kernel, its portable and
AVX-512 paths, split across threads or not), cpu-batch-invariant; flash passes them only to a flash-attn whose
varlen function takes `learnable_sink`, and is refused at start-up otherwise. (Triton: tests/engine/triton.)"""

from __future__ import annotations

import pytest
import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.flash_backend import FlashAttentionBackend, FlashKernel
from engine.attention.invariant_backend import BatchInvariantCpuBackend
from engine.attention.layer_attention import SINKS, LayerAttention, check_backend_serves
from engine.attention.torch_backend import TorchAttentionBackend
from tests.engine.paged_steps import random_paged_step, reference_attention
from tests.engine.test_layer_attention import MIXED, run_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# sinks well above and below the scores: the sink takes most of a head's weight, or almost none
SINKS_VALUES = torch.tensor([3.0, -2.0, 0.5, 8.0])


def sink_layers() -> list[LayerAttention]:
    return [
        LayerAttention(0.25, sinks=SINKS_VALUES),
        LayerAttention(0.25, sliding_window=7, sinks=SINKS_VALUES),
        LayerAttention(0.3, sliding_window=16, softcap=1.5, sinks=-SINKS_VALUES),
    ]


@pytest.fixture(params=["torch", "cpu", "cpu-batch-invariant"])
def backend(request, cpu_kernels):
    return {
        "torch": TorchAttentionBackend,
        "cpu": lambda: CpuAttentionBackend(cpu_kernels),
        "cpu-batch-invariant": lambda: BatchInvariantCpuBackend(cpu_kernels),
    }[request.param]()


@pytest.mark.parametrize("head_dim", [16, 64])  # the native kernel's portable loops, and its AVX-512 path
@pytest.mark.parametrize("index", range(3), ids=["sinks", "window", "window-cap"])
def test_backends_add_the_sinks_to_the_denominator(backend, index, head_dim):
    layer = sink_layers()[index]
    assert SINKS in backend.attention_features
    step = random_paged_step(
        MIXED, 3, block_size=4, num_heads=4, num_kv_heads=2, head_dim=head_dim, num_blocks=64, seed=head_dim
    )
    got = run_step(backend, step, layer)
    expected = reference_attention(step, layer.scale, layer.sliding_window, layer.softcap, layer.sinks)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)
    plain = reference_attention(step, layer.scale, layer.sliding_window, layer.softcap)
    assert (expected - plain).abs().max() > 0.1  # the sinks matter here


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("split", [True, False])
def test_native_decode_merges_split_parts_with_the_sinks(cpu_kernels, head_dim, split):
    """Long sequences split across threads: the merge of the parts counts each sink once."""
    step = random_paged_step(
        [(900, 1), (520, 1)], 2, block_size=16, num_heads=4, num_kv_heads=2, head_dim=head_dim, num_blocks=96, seed=3
    )
    backend = CpuAttentionBackend(cpu_kernels)
    layer = LayerAttention(0.2, sliding_window=700, sinks=SINKS_VALUES)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        backend.split_sequences = split
        got = run_step(backend, step, layer)
    finally:
        torch.set_num_threads(threads)
    expected = reference_attention(step, 0.2, 700, None, SINKS_VALUES)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


def test_native_decode_with_sinks_in_bfloat16(cpu_kernels):
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
    layer = LayerAttention(0.125, sliding_window=20, sinks=SINKS_VALUES)
    got = run_step(CpuAttentionBackend(cpu_kernels), step, layer)
    expected = reference_attention(step, layer.scale, layer.sliding_window, None, layer.sinks)
    torch.testing.assert_close(got.double(), expected, atol=3e-2, rtol=3e-2)


class RecordingVarlen:
    """A flash-attn 4 varlen function, with or without `learnable_sink`: records its keyword arguments."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, q, k, v, **kwargs):
        self.calls.append(kwargs)
        return torch.zeros_like(q)


def test_flash_passes_sinks_to_a_release_that_takes_them():
    varlen = RecordingVarlen()
    backend = FlashAttentionBackend(FlashKernel(4, "test", varlen, takes_sinks=True))
    assert SINKS in backend.attention_features
    step = random_paged_step(
        [(9, 1), (12, 5)], 1, block_size=4, num_heads=4, num_kv_heads=2, head_dim=16, num_blocks=16
    )
    for layer in (LayerAttention(0.5), LayerAttention(0.5, sliding_window=8, sinks=SINKS_VALUES)):
        run_step(backend, step, layer)
    plain, with_sinks = varlen.calls
    assert "learnable_sink" not in plain
    assert with_sinks["learnable_sink"].dtype == torch.bfloat16  # the only dtype flash-attn 4 takes them in
    torch.testing.assert_close(with_sinks["learnable_sink"].float(), SINKS_VALUES)


def test_a_flash_attn_without_sinks_is_refused_at_start_up():
    backend = FlashAttentionBackend(FlashKernel(2, "2.8", RecordingVarlen()))
    assert SINKS not in backend.attention_features
    with pytest.raises(
        ValueError,
        match=r"'flash \(flash-attn 2\)' cannot serve GptOssForCausalLM: it does not "
        r"implement attention sinks",
    ):
        check_backend_serves(backend, sink_layers(), "GptOssForCausalLM")


def test_flash_takes_sinks_only_where_the_signature_names_them():
    from engine.attention.flash_backend import _layer_options

    assert _layer_options(frozenset({"window_size", "softcap", "learnable_sink"}))["takes_sinks"]
    assert not _layer_options(frozenset({"window_size", "softcap"}))["takes_sinks"]
    assert not _layer_options(None)["takes_sinks"]  # no signature: a newer feature is not assumed
