"""The native CPU kernels as torch operators (engine/kernels/cpu_ops.py): schemas, fake implementations
and in-place annotations checked by torch's own `opcheck`, and torch.compile tracing a layer's worth of
them in one graph with the eager results."""

from __future__ import annotations

import pytest
import torch

from engine.layers.layer_ops import NativeLayerOps
from engine.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


def _inputs(kernels, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(dtype)
    gate_up = torch.randn(5, 96, generator=g).to(dtype)
    weight = torch.rand(64, generator=g).to(dtype) + 0.5
    query = torch.randn(3, 4, 16, generator=g).to(dtype)
    keys = torch.randn(6, 4, 2, 16, generator=g).to(dtype)
    values = torch.randn(6, 4, 2, 16, generator=g).to(dtype)
    tables = torch.tensor([[3, 1, 5], [0, 2, 4], [5, 5, 5]], dtype=torch.int32)
    lens = torch.tensor([9, 4, 1], dtype=torch.int32)
    rope = RotaryEmbedding(16, 64, 10000.0, None, dtype, torch.device("cpu"))
    qk = torch.randn(5, 6, 16, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 7, 8, 63])
    fn = kernels._function
    return {
        "cpu_paged_decode": (query, keys, values, tables, lens, 0.25, 1, 0, 0.0, None, fn("paged_decode", dtype)),
        "cpu_rms_norm": (x, weight, 1e-5, fn("rms_norm", dtype)),
        "cpu_add_rms_norm": (x, x.clone() * 2, weight, 1e-5, fn("add_rms_norm", dtype)),
        "cpu_silu_and_mul": (gate_up, fn("silu_and_mul", dtype)),
        "cpu_gelu_tanh_and_mul": (gate_up, fn("gelu_tanh_and_mul", dtype)),
        "cpu_rotary_": (qk, positions, rope.cos, rope.sin_signed, fn("rotary", dtype)),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_passes_for_every_operator(cpu_kernels, dtype):
    for name, args in _inputs(cpu_kernels, dtype).items():
        op = getattr(torch.ops.pagedserve, name).default
        results = torch.library.opcheck(
            op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
        )
        assert set(results.values()) == {"SUCCESS"}, (name, results)


def test_torch_compile_traces_a_layer_of_native_ops_in_one_graph(cpu_kernels):
    """fullgraph=True: any graph break (an op dynamo could not trace) fails the compile."""
    ops = NativeLayerOps(cpu_kernels)
    rope = RotaryEmbedding(16, 64, 10000.0, None, torch.float32, torch.device("cpu"))
    inputs = _inputs(cpu_kernels, torch.float32)
    query, keys, values, tables, lens, *_ = inputs["cpu_paged_decode"]

    def layer(x, residual, weight, gate_up, qk, positions, query):
        normed = ops.add_rms_norm(x, residual, weight, 1e-5)[0]
        act = ops.silu_and_mul(gate_up)
        rotated = ops.rotary(qk, positions, rope)
        attended = cpu_kernels.paged_decode(query, keys, values, tables, lens, 0.25)
        return normed, residual, act, rotated, attended, ops.rms_norm(normed, weight, 1e-5)

    def args():
        g = torch.Generator().manual_seed(1)
        return (
            torch.randn(5, 64, generator=g),
            torch.randn(5, 64, generator=g),
            torch.rand(64, generator=g) + 0.5,
            torch.randn(5, 96, generator=g),
            torch.randn(5, 6, 16, generator=g),
            torch.tensor([0, 3, 7, 8, 63]),
            query.clone(),
        )

    eager = layer(*args())
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(*args())
    for want, got in zip(eager, compiled):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
