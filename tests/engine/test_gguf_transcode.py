"""GGUF types the kernels do not read (k-quants and the rest) carried into Q4_1 / Q8_0 blocks at load
(engine/quantization/gguf_transcode.py), against gguf-py's own dequantization of the source blocks:
Q4_K's quants exact and its steps and offsets within fp16 rounding, the others within one Q8_0 step; and a
GGUF file holding them reads into GgufWeights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels.quant import QUANT_SOURCES, load_quant_kernels
from engine.quantization.gguf_transcode import transcode
from engine.quantization.gguf_weight import GgufWeight

FP16_HALF_ULP = 2.0**-11  # relative rounding of a float16


@pytest.fixture(scope="module")
def kernels():
    return load_quant_kernels(sources=QUANT_SOURCES)


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_q4_k(rng, rows: int, in_features: int) -> np.ndarray:
    """Rows of Q4_K super-blocks: random fp16 d and dmin of weight-like size, random scale bytes and quants."""
    supers = in_features // 256
    d = _fp16_bytes(rng.uniform(1e-4, 2e-3, (rows, supers, 1)))
    dmin = _fp16_bytes(rng.uniform(1e-4, 2e-3, (rows, supers, 1)))
    scales = rng.integers(0, 256, (rows, supers, 12), dtype=np.uint8)
    quants = rng.integers(0, 256, (rows, supers, 128), dtype=np.uint8)
    blocks = np.concatenate([d.reshape(rows, supers, 2), dmin.reshape(rows, supers, 2), scales, quants], axis=-1)
    return blocks.reshape(rows, supers * 144)


def random_q6_k(rng, rows: int, in_features: int) -> np.ndarray:
    """Rows of Q6_K super-blocks: random low and high quant bits, int8 scales, an fp16 d."""
    supers = in_features // 256
    bits = rng.integers(0, 256, (rows, supers, 128 + 64), dtype=np.uint8)
    scales = rng.integers(-128, 128, (rows, supers, 16)).astype(np.int8).view(np.uint8)
    d = _fp16_bytes(rng.uniform(1e-5, 1e-4, (rows, supers, 1))).reshape(rows, supers, 2)
    return np.concatenate([bits, scales, d], axis=-1).reshape(rows, supers * 210)


def _reference(raw: np.ndarray, type_name: str, in_features: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType[type_name]).reshape(raw.shape[0], in_features).astype(np.float64)


def test_q4_k_keeps_its_quants_and_rounds_its_scales_to_fp16(kernels):
    from gguf.quants import Q4_K

    rng = np.random.default_rng(0)
    rows, in_features = 24, 768
    raw = random_q4_k(rng, rows, in_features)
    fmt, packed = transcode("Q4_K", raw, in_features)
    assert fmt.name == "q4_1" and packed.nbp == in_features // 32
    assert packed.qs.numpy().tobytes() == raw.reshape(rows, -1, 144)[:, :, 16:].tobytes()  # quants as stored
    got = GgufWeight(fmt, packed, in_features, kernels).dequantize().double().numpy()
    expected = _reference(raw, "Q4_K", in_features)
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
    scales, mins = Q4_K.get_scale_min(blocks[:, 4:16])
    step = np.repeat((d * scales).reshape(rows, -1), 32, axis=1)  # per element: its block's exact step, offset
    offset = np.repeat((dmin * mins).reshape(rows, -1), 32, axis=1)
    bound = (15 * step + offset) * FP16_HALF_ULP + 1e-9
    assert np.all(np.abs(got - expected) <= bound)
    assert np.abs(got - expected).max() > 0  # the scales were rounded (a test of something)


@pytest.mark.parametrize("type_name", ["Q6_K", "Q5_0"])
def test_other_types_are_requantized_to_q8_0_within_one_step(kernels, type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(1)
    rows, in_features = 16, 512
    if type_name == "Q6_K":
        raw = random_q6_k(rng, rows, in_features)
    else:
        raw = quantize(rng.standard_normal((rows, in_features)).astype(np.float32), GGMLQuantizationType.Q5_0)
    fmt, packed = transcode(type_name, raw, in_features)
    assert fmt.name == "q8_0"
    got = GgufWeight(fmt, packed, in_features, kernels).dequantize().double().numpy()
    expected = _reference(raw, type_name, in_features)
    amax = np.repeat(np.abs(expected).reshape(rows, -1, 32).max(axis=-1), 32, axis=1)
    step = amax / 127
    assert np.all(np.abs(got - expected) <= step * (0.5 + 2 * FP16_HALF_ULP * 127) + 1e-12)


def test_blocks_with_scales_beyond_fp16_are_not_carried():
    rng = np.random.default_rng(2)
    raw = random_q4_k(rng, 2, 256)
    blocks = raw.reshape(-1, 144)
    blocks[:, 0:2] = _fp16_bytes(np.full((2, 1), 60000.0)).reshape(2, 2)  # d * scale overflows fp16
    blocks[:, 4:16] = 63  # every 6-bit scale and min 63
    assert transcode("Q4_K", raw, 256) is None  # the loader keeps float32 values


def test_a_gguf_file_with_k_quants_reads_into_kept_blocks(tmp_path, kernels):
    from gguf import GGMLQuantizationType as T

    from engine.loading.gguf_weights import iter_gguf_weights
    from tests.engine.test_gguf_quant_model import write_gguf

    rng = np.random.default_rng(3)
    q4k = random_q4_k(rng, 8, 256)
    q6k = random_q6_k(rng, 4, 256)
    path = tmp_path / "k.gguf"
    write_gguf(path, "qwen2", {"blk.0.ffn_up.weight": (q4k, T.Q4_K), "blk.0.ffn_down.weight": (q6k, T.Q6_K)})
    got = dict(iter_gguf_weights(path, kernels, num_heads=2, num_kv_heads=1))
    up, down = got["model.layers.0.mlp.up_proj.weight"], got["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(up, GgufWeight) and up.format == "q4_1" and (up.out_features, up.in_features) == (8, 256)
    assert isinstance(down, GgufWeight) and down.format == "q8_0" and (down.out_features, down.in_features) == (4, 256)
    expected = _reference(q4k, "Q4_K", 256)  # within fp16 rounding of the larger terms (step x 15, offset)
    np.testing.assert_allclose(
        up.dequantize().double().numpy(), expected, rtol=0, atol=4 * FP16_HALF_ULP * np.abs(expected).max()
    )
    x = torch.randn(3, 256)
    np.testing.assert_allclose(down.matmul(x).numpy(), x.numpy() @ down.dequantize().numpy().T, rtol=0.05, atol=0.05)
