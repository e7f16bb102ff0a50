"""The embedded SmolLM2 GGUF loaded with `quantization="gguf"` (Q4_1 projections and the Q8_0 embedding /
LM head kept quantized) against the same weights dequantized to float32 (`quantization="none"`), and the
pieces of the loading: names, the q/k row un-permutation, the flag's resolution."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.gguf_weights import hf_name, unpermute_rows
from engine.quantization.gguf_weight import GgufWeight
from engine.loading.model_weights import resolve_gguf_storage

TEXTS = [  # scored teacher-forced: the model's greedy choice at every position, on both paths
    "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre and its cafes, and the "
    "river Seine runs through the middle of the city.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
]
CPU = torch.device("cpu")


def hf_reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """HF transformers' GGUF loader's un-permutation of llama q/k rows (modeling_gguf_pytorch_utils)."""
    dim = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, dim, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def test_unpermute_rows_is_hfs_reverse_permutation():
    for rows, heads in ((576, 9), (192, 3), (8, 2)):
        stored = np.arange(rows * 3).reshape(rows, 3)
        np.testing.assert_array_equal(stored[unpermute_rows(rows, heads).numpy()], hf_reverse_permute(stored, heads))


def test_gguf_names_map_to_hf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    with pytest.raises(KeyError, match="blk.0.ffn_gate_exps.weight"):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_the_flag_resolves_or_says_why_not(tmp_path):
    gguf = tmp_path / "m.gguf"
    assert resolve_gguf_storage("gguf", gguf, CPU, torch.bfloat16) == "gguf"
    assert resolve_gguf_storage("none", gguf, CPU, torch.bfloat16) == "none"
    assert resolve_gguf_storage("auto", None, CPU, torch.float32) == "none"
    refusals = [
        ((None, CPU, torch.float32, False), "not a .gguf file"),
        ((gguf, torch.device("cuda"), torch.float32, False), "CPU only"),
        ((gguf, CPU, torch.float16, False), "not float16"),
        ((gguf, CPU, torch.float32, True), "batch-invariant"),
    ]
    for args, reason in refusals:
        with pytest.raises(ValueError, match=reason):
            resolve_gguf_storage("gguf", *args)
        assert resolve_gguf_storage("auto", *args) == "none"
    with pytest.raises(ValueError, match="unknown quantization"):
        resolve_gguf_storage("int3", gguf, CPU, torch.float32)


@pytest.fixture(scope="module")
def llms(embedded_checkpoint):
    options = dict(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="32MiB")
    # prefill chunks of 5 tokens: every product of the quantized path runs the integer (decode) kernel
    with (
        LLM(None, quantization="gguf", max_num_batched_tokens=5, max_num_seqs=4, **options) as quantized,
        LLM(None, quantization="none", **options) as plain,
    ):
        yield quantized, plain  # shut down after the module, not kept for the rest of the run


def test_weights_stay_quantized(llms):
    model = llms[0].engine.runner.model
    assert model.quantization == "gguf"
    layer = model.layers[0]
    assert all(
        isinstance(w, GgufWeight) and w.format == "q4_1" for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    )
    assert (layer.qkv.out_features, layer.gate_up.out_features) == (576 + 2 * 192, 2 * 1536)
    assert model.lm_head is model.embed and model.embed.format == "q8_0"  # tied: one Q8_0 matrix
    assert model.weight_bytes() < 100e6 < llms[1].engine.runner.model.weight_bytes()


def test_greedy_tokens_and_logprobs_follow_the_float_weights(llms):
    """At most positions of a few texts the quantized path's greedy choice is the float path's, and its
    logprobs of the texts' tokens stay close (int8 activations: the decode path)."""
    quantized, float_path = llms
    tokenizer = float_path.get_tokenizer()
    sequences = [tokenizer.encode(text) for text in TEXTS]
    scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    agree = total = 0
    gaps = []
    for q_result, f_result in zip(
        quantized.generate(sequences, scoring, use_tqdm=False), float_path.generate(sequences, scoring, use_tqdm=False)
    ):
        for q_lp, f_lp in zip(q_result.prompt_logprobs[1:], f_result.prompt_logprobs[1:]):
            agree += q_lp.top[0][0] == f_lp.top[0][0]
            total += 1
            gaps.append(abs(q_lp.logprob - f_lp.logprob))
    assert total > 50
    assert agree / total >= 0.9, f"{agree} of {total} positions agree"
    # mean gap measured 0.050 on a Xeon with AMX (oneDNN's float32 products there), below 0.05 on an AMD EPYC
    assert float(np.mean(gaps)) < 0.065 and max(gaps) < 0.5, (float(np.mean(gaps)), max(gaps))


def write_gguf(path: Path, architecture: str, tensors: dict) -> None:
    """A GGUF file of the given tensors: name -> (float32 array [out, in] or [n], GGML type), or (uint8 rows
    of blocks already in that type, the type)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    writer = GGUFWriter(str(path), architecture)
    for name, (array, qtype) in tensors.items():
        if array.dtype == np.uint8:
            writer.add_tensor(name, array, raw_dtype=qtype)
        elif qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_gguf_file_reads_into_hf_names_kept_quantized(tmp_path, architecture):
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    from engine.kernels.quant import QUANT_SOURCES, load_quant_kernels
    from engine.loading.gguf_weights import iter_gguf_weights

    rng = np.random.default_rng(3)
    q = rng.standard_normal((8, 64)).astype(np.float32)  # 2 heads of 4 dims
    tensors = {
        "blk.0.attn_q.weight": (q, T.Q4_1),
        "blk.0.attn_k.weight": (q[:4].copy(), T.Q8_0),  # 1 kv head
        "blk.0.ffn_down.weight": (rng.standard_normal((64, 96)).astype(np.float32), T.Q4_0),
        "blk.0.attn_output.weight": (rng.standard_normal((64, 64)).astype(np.float32), T.F16),
        "blk.0.attn_norm.weight": (rng.standard_normal(64).astype(np.float32), T.F32),
        "output.weight": (rng.standard_normal((10, 64)).astype(np.float32), T.Q8_0),
    }
    path = tmp_path / "m.gguf"
    write_gguf(path, architecture, tensors)
    got = dict(iter_gguf_weights(path, load_quant_kernels(sources=QUANT_SOURCES), num_heads=2, num_kv_heads=1))
    assert set(got) == {hf_name(name) for name in tensors}
    assert got["model.layers.0.input_layernorm.weight"].dtype == torch.float32
    assert got["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float16
    for name, (array, qtype) in tensors.items():
        value = got[hf_name(name)]
        if qtype in (T.F32, T.F16):
            np.testing.assert_array_equal(
                value.float().numpy(), array.astype(np.float16 if qtype == T.F16 else np.float32).astype(np.float32)
            )
            continue
        assert isinstance(value, GgufWeight) and value.format == qtype.name.lower()
        expected = dequantize(quantize(array, qtype), qtype)
        part = name.split(".")[-2]  # attn_q, attn_k, ffn_down, output
        heads = {"attn_q": 2, "attn_k": 1}.get(part, 0) if architecture == "llama" else 0
        if heads:
            expected = hf_reverse_permute(expected, heads)
        np.testing.assert_array_equal(value.dequantize().numpy(), expected)


def test_mixed_formats_fuse_as_floats(tmp_path):
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    from engine.kernels.quant import QUANT_SOURCES, load_quant_kernels
    from engine.quantization.gguf_formats import FORMATS, repack
    from engine.loading.model_weights import fuse_rows

    kernels = load_quant_kernels(sources=QUANT_SOURCES)
    rng = np.random.default_rng(5)
    parts, expected = [], []
    for qtype in (T.Q4_1, T.Q8_0):
        raw = quantize(rng.standard_normal((4, 64)).astype(np.float32), qtype)
        name = qtype.name.lower()
        parts.append(GgufWeight(FORMATS[name], repack(FORMATS[name], raw, 64), 64, kernels))
        expected.append(dequantize(raw, qtype))
    same = fuse_rows([parts[0], parts[0]], torch.float32)
    assert isinstance(same, GgufWeight) and same.out_features == 8
    mixed = fuse_rows(parts, torch.float32)
    assert isinstance(mixed, torch.Tensor)
    np.testing.assert_array_equal(mixed.numpy(), np.concatenate(expected))
    with_float = fuse_rows([parts[0], torch.ones(2, 64)], torch.float32)
    np.testing.assert_array_equal(with_float.numpy(), np.concatenate([expected[0], np.ones((2, 64))]))
