"""`--kv-cache-dtype`: a cache narrower than the model (bf16 for an fp32 model) holds twice the tokens in
the same budget and gives nearly the same logprobs and greedy tokens with the torch and cpu backends;
fp8 converts with its scale and halves a bf16 model's cache on CPU too (both backends)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.layer_attention import LayerAttention
from engine.attention.kv_write import write_kv_by_slots
from engine.attention.step_metadata import step_metadata_for
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.flash_backend import FlashAttentionBackend, FlashKernel
from engine.attention.invariant_backend import BatchInvariantCpuBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.attention.kv_cache import KVCacheSpec, from_cache, resolve_kv_cache_dtype, to_cache
from engine.sampling.params import SamplingParams
from tests.engine.references import make_llm

# prompts longer than a prefill chunk, so later chunks read the earlier ones' K/V from the cache
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Once upon a time, in a small town by the sea, "
    "there lived an old engineer who repaired clocks. Every morning she opened the shop.",
]
PARAMS = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=0, logprobs=0)
CPU = torch.device("cpu")


def _run(model_dir, **settings):
    llm = make_llm(model_dir, max_num_batched_tokens=16, **settings)
    return llm, llm.generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bf16_cache_for_an_fp32_model_stays_close(tiny_llama_dir, backend, cpu_kernels):
    if backend == "cpu" and cpu_kernels is None:
        pytest.skip("the native CPU kernels do not build here")
    llm, narrow = _run(tiny_llama_dir, attention_backend=backend, kv_cache_dtype="bfloat16")
    key_cache, _ = llm.engine.runner.kv_cache.layers[0]
    assert key_cache.dtype == torch.bfloat16 and llm.engine.runner.model.dtype == torch.float32
    _, wide = _run(tiny_llama_dir, attention_backend=backend)
    same = total = 0
    for a, b in zip(narrow, wide):
        prompt_a = torch.tensor([e.logprob for e in a.prompt_logprobs[1:]])
        prompt_b = torch.tensor([e.logprob for e in b.prompt_logprobs[1:]])
        torch.testing.assert_close(prompt_a, prompt_b, rtol=0, atol=5e-2)
        assert not torch.equal(prompt_a, prompt_b)  # the chunks did read the rounded cache
        same += sum(x == y for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids))
        total += len(b.outputs[0].token_ids)
    assert same / total >= 0.9


def test_a_bf16_cache_holds_twice_the_tokens(tiny_llama_dir):
    budget = {"num_blocks": None, "kv_cache_memory": "1MiB"}
    wide = make_llm(tiny_llama_dir, **budget).engine.runner.kv_cache
    narrow = make_llm(tiny_llama_dir, kv_cache_dtype="bfloat16", **budget).engine.runner.kv_cache
    assert narrow.spec.bytes_per_block * 2 == wide.spec.bytes_per_block
    assert narrow.num_blocks + 1 == 2 * (wide.num_blocks + 1)  # the budget's blocks, less the padding block


def fake_flash_backend() -> FlashAttentionBackend:
    """The flash backend as start-up would choose it (its kernel never runs here)."""

    def varlen(*args, **kwargs):
        raise AssertionError("flash-attn is never called by these tests")

    return FlashAttentionBackend(FlashKernel(4, "4.0.0b20", varlen))


def test_kv_cache_dtype_resolution_asks_the_backend_and_names_the_flag():
    cpu, invariant = CpuAttentionBackend(kernels=None), BatchInvariantCpuBackend(kernels=None)
    torch_backend = TorchAttentionBackend()
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32, torch_backend) == torch.float16
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int4': choose auto, float32, bfloat16"):
        resolve_kv_cache_dtype("int4", torch.float32, torch_backend)
    assert resolve_kv_cache_dtype("fp8", torch.float32, torch_backend) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, cpu) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, cpu) == torch.float8_e4m3fn  # vLLM's other name
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, torch_backend) == torch.float8_e5m2
    with pytest.raises(
        ValueError,
        match=r"--kv-cache-dtype fp8_e5m2: the cpu attention backend reads a KV cache of "
        r"float32, bfloat16, fp8 for a bfloat16 model; .*--attention-backend torch",
    ):
        resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, cpu)
    with pytest.raises(
        ValueError,
        match=r"--kv-cache-dtype float16: the cpu attention backend reads a KV cache of "
        r"float32, bfloat16, fp8 for a float32 model",
    ):
        resolve_kv_cache_dtype("float16", torch.float32, cpu)
    with pytest.raises(ValueError, match="the cpu-batch-invariant attention backend") as refused:
        resolve_kv_cache_dtype("float16", torch.float32, invariant)
    assert "--attention-backend torch" not in str(refused.value)  # batch-invariant mode takes no other backend
    triton = TritonAttentionBackend.__new__(TritonAttentionBackend)
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, triton) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float16, triton) == torch.float8_e5m2
    assert resolve_kv_cache_dtype("float16", torch.float32, triton) == torch.float16
    flash = fake_flash_backend()
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, flash) == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, flash) == torch.bfloat16
    for name in ("float16", "float32", "fp8"):
        with pytest.raises(
            ValueError,
            match=rf"--kv-cache-dtype {name}: the flash \(flash-attn 4\) attention backend "
            r"reads a KV cache of bfloat16 for a bfloat16 model.*--attention-backend "
            r"torch",
        ):
            resolve_kv_cache_dtype(name, torch.bfloat16, flash)


def test_building_with_flash_refuses_a_cache_dtype_it_cannot_read(tiny_llama_dir, monkeypatch):
    """The check runs at build time against the backend the builder chose, whatever its name says (the flash
    backend is named after its generation, "flash (flash-attn 4)"): before any memory profiling or step."""
    import engine.platform as numerics_module

    chosen = []

    def choose_flash(name, device, dtype, **kwargs):
        chosen.append((name, dtype, kwargs))
        return fake_flash_backend()

    monkeypatch.setattr(numerics_module, "get_attention_backend", choose_flash)
    with pytest.raises(
        ValueError,
        match=r"--kv-cache-dtype float16: the flash \(flash-attn 4\) attention backend "
        r"reads a KV cache of bfloat16",
    ):
        make_llm(tiny_llama_dir, dtype="bfloat16", attention_backend="flash", kv_cache_dtype="float16")
    ((name, dtype, kwargs),) = chosen
    assert name == "flash" and dtype == torch.bfloat16 and kwargs["shape"] == (4, 2, 16)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("model_dir_fixture", ["tiny_llama_dir", "tiny_llama_head64_dir"])
def test_an_fp8_cache_holds_twice_a_bf16_models_tokens_and_stays_close(
    model_dir_fixture, backend, request, cpu_kernels
):
    """`--kv-cache-dtype fp8` on CPU: one byte per element (the budget's blocks doubled against a bf16 cache),
    prompt logprobs within e4m3's rounding of the bf16 cache's (the later chunks read the earlier ones as
    stored; greedy tokens of a random model's near-flat distributions say little); the cpu backend's native kernels and the torch backend's widened
    gathers read the same stored values."""
    if backend == "cpu" and cpu_kernels is None:
        pytest.skip("the native CPU kernels do not build here")
    # heads of 16: the portable decode loops and torch's prompt attention; of 64: the AVX-512 decode and the
    # native prompt attention, where the build has them
    tiny_llama_dir = request.getfixturevalue(model_dir_fixture)
    budget = {"num_blocks": None, "kv_cache_memory": "1MiB", "dtype": "bfloat16", "attention_backend": backend}
    llm, narrow = _run(tiny_llama_dir, kv_cache_dtype="fp8", **budget)
    fp8_cache = llm.engine.runner.kv_cache
    assert fp8_cache.layers[0][0].dtype == torch.float8_e4m3fn
    wide_llm, wide = _run(tiny_llama_dir, **budget)
    assert fp8_cache.num_blocks + 1 == 2 * (wide_llm.engine.runner.kv_cache.num_blocks + 1)
    for a, b in zip(narrow, wide):
        prompt_a = torch.tensor([e.logprob for e in a.prompt_logprobs[1:]])
        prompt_b = torch.tensor([e.logprob for e in b.prompt_logprobs[1:]])
        # logprobs near -7 (the tiny random model's spread over its vocabulary): within e4m3's 2^-4 of them
        difference = (prompt_a - prompt_b).abs()
        assert difference.mean() < 0.1 and difference.max() < 0.5
        assert not torch.equal(prompt_a, prompt_b)  # the chunks did read the rounded cache
    if backend == "cpu":  # against the torch backend, fp8 both: bf16 sums apart, then rounded to e4m3 apart
        _, reference = _run(tiny_llama_dir, kv_cache_dtype="fp8", **{**budget, "attention_backend": "torch"})
        for a, b in zip(narrow, reference):
            difference = (
                torch.tensor([e.logprob for e in a.prompt_logprobs[1:]])
                - torch.tensor([e.logprob for e in b.prompt_logprobs[1:]])
            ).abs()
            assert difference.mean() < 0.05 and difference.max() < 0.3


@pytest.mark.parametrize(
    "fp8, mantissa_bits, smallest", [(torch.float8_e4m3fn, 3, 2**-9), (torch.float8_e5m2, 2, 2**-16)]
)
def test_fp8_cache_round_trip_and_decode_in_the_torch_backend(fp8, mantissa_bits, smallest):
    """The torch backend's fp8 path (the CUDA one) runs on CPU tensors too: writes scale into e4m3 or e5m2,
    reads back to the query's dtype; a decode over an fp8 cache stays within the format's rounding of the fp32
    one."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 16, generator=generator)
    back = from_cache(to_cache(x, fp8), torch.float32)
    assert back.dtype == torch.float32 and not torch.equal(back, x)
    assert ((back - x).abs() <= x.abs() / 2 ** (mantissa_bits + 1) + smallest).all()  # half an ulp, nearest
    outputs = {}
    for dtype in (torch.float32, fp8):
        spec = KVCacheSpec(1, 4, 2, 16, dtype)
        caches = [torch.zeros(9, 4, 2, 16, dtype=dtype) for _ in range(2)]
        keys, values = torch.randn(2, 12, 2, 16, generator=torch.Generator().manual_seed(1))
        slots = torch.arange(12)
        backend = TorchAttentionBackend()
        write_kv_by_slots(keys, values, caches[0], caches[1], slots)
        query = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(2))
        # two decodes: 12 cached tokens in blocks 0-2, and 7 in blocks 0-1
        step = step_metadata_for([(12, 1, [0, 1, 2]), (7, 1, [0, 1])], torch.tensor([11, 6]), 2, CPU)
        metadata = backend.build_metadata(step, spec)
        outputs[dtype] = backend.attend(query, None, None, caches[0], caches[1], metadata, LayerAttention(0.25))
    torch.testing.assert_close(outputs[fp8], outputs[torch.float32], rtol=0, atol=0.1 * 2 ** (3 - mantissa_bits))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_writes_saturate_at_the_formats_largest_value(fp8):
    """K/V beyond the format's range are stored as its largest finite value (as vLLM's SATFINITE conversion
    does), never as an infinity that would turn the attention into NaN: torch clamps e4m3 itself, not e5m2."""
    limit = torch.finfo(fp8).max  # 448, 57344
    x = torch.tensor([1e6, -1e6, 7e4, -7e4, limit, 1.0, float("inf")])
    stored = to_cache(x, fp8).float()
    assert torch.isfinite(stored).all()
    assert stored.tolist() == [limit, -limit, limit, -limit, limit, 1.0, limit]  # 7e4 is past both formats' range
