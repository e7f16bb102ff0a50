"""The native prefill attentions (csrc/prefill_attention.cpp for bf16, prefill_attention_f32.cpp for float32)
against float64 softmax attention: prompt chunks that start a sequence or continue a cached prefix, read from a
paged cache with scattered blocks; GQA groups of 1 to 7; head_dim 64 and 128; chunks across their position
tiles and key tiles; and the CPU backend routing chunks to them (bf16 on AVX512-BF16 builds of CPUs without AMX,
float32 over float32, bf16 or fp8 caches on AVX-512 or AVX2 builds; other dtypes and builds keep torch's
attention)."""

from __future__ import annotations

import platform
from typing import Optional

import pytest
import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.layer_attention import LayerAttention
from engine.attention.metadata import PrefillChunk
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.amx import torch_bf16_products_use_amx
from engine.kernels.cpu import load_cpu_kernels
from tests.engine.cpu_flags import FLOAT32_TILE_ARCHES, cpu_has, kernels_for
from tests.engine.non_finite import plant_non_finite

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def kernels(cpu_kernels):
    if not cpu_kernels.prefill_attention_serves(BF16, BF16):
        pytest.skip("this build has no AVX512-BF16: torch's attention serves bf16 prompt chunks")
    return cpu_kernels


@pytest.fixture(scope="module", params=["native", *FLOAT32_TILE_ARCHES])
def f32_kernels(request, cpu_kernels):
    """The float32 kernel of this CPU's build, and of the AVX2 (haswell) and AVX-512 (skylake-avx512) builds
    where this CPU runs them."""
    kernels = kernels_for(request.param, cpu_kernels)
    if not kernels.prefill_attention_serves(torch.float32, torch.float32):
        pytest.skip("this build has neither AVX-512 nor AVX2: torch's attention serves float32 prompt chunks")
    return kernels


def _paged(gen, context: int, block_size: int, kv_heads: int, head_dim: int, dtype=BF16):
    """A cache of scattered blocks holding `context` tokens, and its block table (a spare block unused)."""
    blocks = -(-context // block_size)
    num_blocks = blocks + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:blocks].int()
    return key_cache, value_cache, table


def _reference(query, key_cache, value_cache, table, context: int, scale: float) -> torch.Tensor:
    """float64 causal attention: query i (position context - Q + i) over the keys [0, that position]."""
    query_len, heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    keys = key_cache[table.long()].reshape(-1, kv_heads, head_dim)[:context].double()
    values = value_cache[table.long()].reshape(-1, kv_heads, head_dim)[:context].double()
    keys = keys.repeat_interleave(heads // kv_heads, 1)
    values = values.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * scale
    positions = torch.arange(context - query_len, context)
    scores = scores.masked_fill(torch.arange(context)[None, :] > positions[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


# query_len, prefix, heads, kv_heads, head_dim, block_size
SHAPES = [
    (1, 0, 9, 3, 64, 16),  # a one-token prompt
    (5, 0, 9, 3, 64, 16),  # SmolLM2's heads, a short first chunk
    (33, 0, 9, 3, 64, 16),  # two position tiles, the second of one position
    (100, 37, 9, 3, 64, 16),  # a chunk over a prefix that ends mid-block
    (64, 200, 8, 2, 128, 16),  # groups of 4, head_dim 128
    (17, 50, 4, 4, 128, 5),  # groups of 1, blocks of 5: key tiles span blocks
    (70, 1000, 14, 2, 64, 32),  # groups of 7, a long prefix
    (1, 77, 2, 1, 64, 16),  # one query over a prefix (a chunk of one token)
]


@pytest.mark.parametrize("cache_dtype", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("query_len, prefix, heads, kv_heads, head_dim, block_size", SHAPES)
def test_matches_float64_reference(kernels, query_len, prefix, heads, kv_heads, head_dim, block_size, cache_dtype):
    """bf16 caches, and fp8 ones (--kv-cache-dtype fp8) against the reference over the values they store."""
    gen = torch.Generator().manual_seed(query_len * 1000 + prefix + head_dim)
    context = prefix + query_len
    key_cache, value_cache, table = _paged(gen, context, block_size, kv_heads, head_dim, cache_dtype)
    # a spread of score magnitudes: the running maximum grows along the keys and rescales the sums
    query = (torch.randn(query_len, heads, head_dim, generator=gen) * 2).bfloat16()
    scale = head_dim**-0.5
    got = kernels.prefill_attention(query, key_cache, value_cache, table, context, scale)
    assert got.shape == query.shape and got.dtype == torch.bfloat16
    expected = _reference(query, key_cache, value_cache, table, context, scale)
    # bf16: the output's rounding (2^-9) and the probabilities rounded to bf16 for P.V
    torch.testing.assert_close(got.double(), expected, atol=1.5e-2, rtol=1.5e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float32, BF16, FP8], ids=["float32", "bf16", "fp8"])
@pytest.mark.parametrize("query_len, prefix, heads, kv_heads, head_dim, block_size", SHAPES)
def test_float32_matches_float64_reference(
    f32_kernels, query_len, prefix, heads, kv_heads, head_dim, block_size, cache_dtype
):
    """float32 caches, and bf16 or fp8 ones (--kv-cache-dtype under a float32 model: widened exactly as each key
    tile is read) against the reference over the values they store."""
    gen = torch.Generator().manual_seed(query_len * 1000 + prefix + head_dim)
    context = prefix + query_len
    key_cache, value_cache, table = _paged(gen, context, block_size, kv_heads, head_dim, cache_dtype)
    query = torch.randn(query_len, heads, head_dim, generator=gen) * 2
    scale = head_dim**-0.5
    got = f32_kernels.prefill_attention(query, key_cache, value_cache, table, context, scale)
    assert got.shape == query.shape and got.dtype == torch.float32
    expected = _reference(query, key_cache, value_cache, table, context, scale)
    # float32 sums over up to ~1,000 keys (the 2^-24 rounding of each, and the exponential's ~2e-7)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


def _non_finite(case: str, dtype, cache_dtype):
    """A chunk of 40 queries after a 60-token prefix (9 heads over 3 kv heads) with one NaN or infinity where a
    model's overflow would put it: query 10's head 4; key 75 (in the chunk: the rows before it do not see it) or
    value 50 (in the prefix) of kv head 1, dim 5. (A NaN value inside the chunk reaches the earlier rows of its
    position tile as 0 x NaN, as it does in flash-attn's tiles.)"""
    gen = torch.Generator().manual_seed(21)
    key_cache, value_cache, table = _paged(gen, 100, 16, 3, 64, torch.float32)
    query = torch.randn(40, 9, 64, generator=gen)
    position = 50 if case == "value_nan" else 75
    block, slot = table[position // 16], position % 16
    if case.startswith("minus_inf"):  # head 3-5's scores -inf: the first 32 keys' (a key tile), or all
        key_cache[table[: 2 if case == "minus_inf_first_tile" else None].long(), :, 1, 5] = torch.inf
        query[:, 3:6, 5] = -1.0
    else:
        plant_non_finite(case, query, key_cache, value_cache, block, slot, nan_row=10, inf_rows=slice(None))
    return query.to(dtype), key_cache.to(cache_dtype), value_cache.to(cache_dtype), table


def _assert_nan_where_float64_is(got, query, key_cache, value_cache, table, tolerance, some_nan=True):
    expected = _reference(query, key_cache, value_cache, table, 100, 0.125)
    nan = expected.isnan()
    assert nan[:, 3:6].any() == some_nan and not nan[:, [0, 1, 2, 6, 7, 8]].any()  # kv head 1's query heads alone
    assert torch.equal(got.isnan(), nan)
    torch.testing.assert_close(got.double()[~nan], expected[~nan], atol=tolerance, rtol=tolerance)


NON_FINITE = ["query_nan", "key_nan", "key_inf", "value_nan", "minus_inf_first_tile", "minus_inf_everywhere"]


@pytest.mark.parametrize("case", NON_FINITE)
def test_non_finite_inputs_give_nan_where_float64_does(kernels, case):
    """A model's overflow reaching the bf16 kernel as a NaN or an infinity: NaN exactly where float64 softmax
    attention is NaN (a NaN or +inf score makes its row's softmax NaN, a -inf score weighs 0, a NaN value spoils
    its dim), never a finite number that would hide the fault from the engine's check of the logits."""
    query, key_cache, value_cache, table = _non_finite(case, BF16, BF16)
    got = kernels.prefill_attention(query, key_cache, value_cache, table, 100, 0.125)
    _assert_nan_where_float64_is(got, query, key_cache, value_cache, table, 1.5e-2, case != "minus_inf_first_tile")


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8], ids=["float32", "fp8"])
@pytest.mark.parametrize("case", NON_FINITE)
def test_float32_non_finite_inputs_give_nan_where_float64_does(f32_kernels, case, cache_dtype):
    """The same for the float32 kernel of each build (an fp8 cache stores an infinity as 448: no NaN there)."""
    query, key_cache, value_cache, table = _non_finite(case, torch.float32, cache_dtype)
    got = f32_kernels.prefill_attention(query, key_cache, value_cache, table, 100, 0.125)
    some_nan = case != "minus_inf_first_tile" and not ("inf" in case and cache_dtype == FP8)
    _assert_nan_where_float64_is(got, query, key_cache, value_cache, table, 2e-5, some_nan)


def test_float32_builds_agree_bit_for_bit_at_head_dim_64():
    """Each row's sums run in one lane, over the keys in order: the AVX2 and AVX-512 builds give the same bits
    where their key tiles are the same size (32 keys; AVX-512 takes 16 at head_dim 128)."""
    arches = [arch for arch, flags in FLOAT32_TILE_ARCHES.items() if cpu_has(*flags)]
    if platform.machine() not in ("x86_64", "AMD64") or len(arches) < 2:
        pytest.skip("this CPU cannot run both the haswell and the skylake-avx512 builds")
    gen = torch.Generator().manual_seed(8)
    key_cache, value_cache, table = _paged(gen, 500, 16, 3, 64, torch.float32)
    query = torch.randn(150, 9, 64, generator=gen) * 2
    outputs = []
    for arch in arches:
        kernels = load_cpu_kernels(arch=arch)
        assert kernels is not None
        outputs.append(kernels.prefill_attention(query, key_cache, value_cache, table, 500, 0.125))
    assert torch.equal(outputs[0], outputs[1])


def test_fp8_caches_without_vbmi_widen_alike(kernels):
    """A build for an AVX512-BF16 CPU without VBMI (Cooper Lake) widens fp8 by arithmetic, not byte lookups:
    the same bits as the native build (whose conversions are exact either way)."""
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_has("avx512_bf16", "avx512bw", "avx512vbmi"):
        pytest.skip("this CPU cannot run -march=cooperlake code, or its native build has no VBMI to compare")
    cooperlake = load_cpu_kernels(arch="cooperlake")
    assert cooperlake is not None and cooperlake.prefill_attention_serves(BF16, FP8)
    gen = torch.Generator().manual_seed(9)
    key_cache, value_cache, table = _paged(gen, 300, 16, 3, 64, FP8)
    query = torch.randn(100, 9, 64, generator=gen).bfloat16()
    assert torch.equal(
        cooperlake.prefill_attention(query, key_cache, value_cache, table, 300, 0.125),
        kernels.prefill_attention(query, key_cache, value_cache, table, 300, 0.125),
    )


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "float32"])
def test_one_thread_and_the_team_agree(cpu_kernels, dtype):
    """Work items (kv head, position tile) are independent: the thread count does not change a bit."""
    if not cpu_kernels.prefill_attention_serves(dtype, dtype):
        pytest.skip(f"this build has no {dtype} prefill attention")
    gen = torch.Generator().manual_seed(3)
    key_cache, value_cache, table = _paged(gen, 300, 16, 3, 64, dtype)
    query = torch.randn(100, 9, 64, generator=gen).to(dtype)
    team = cpu_kernels.prefill_attention(query, key_cache, value_cache, table, 300, 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = cpu_kernels.prefill_attention(query, key_cache, value_cache, table, 300, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(team, alone)


def test_rejects_what_it_cannot_serve(kernels):
    gen = torch.Generator().manual_seed(4)
    key_cache, value_cache, table = _paged(gen, 40, 16, 2, 80)
    with pytest.raises(ValueError, match="head_dim 80"):
        kernels.prefill_attention(torch.randn(8, 4, 80).bfloat16(), key_cache, value_cache, table, 40, 0.1)
    key_cache, value_cache, table = _paged(gen, 40, 16, 2, 64)
    with pytest.raises(ValueError, match="no prefill attention kernel in this build for torch.float16 queries"):
        kernels.prefill_attention(torch.randn(8, 4, 64).half(), key_cache, value_cache, table, 40, 0.1)
    with pytest.raises(ValueError, match="block table"):
        kernels.prefill_attention(torch.randn(8, 4, 64).bfloat16(), key_cache, value_cache, table, 400, 0.1)


def _layer(head_dim: int) -> LayerAttention:
    return LayerAttention(scale=head_dim**-0.5)


def _chunk_of_cache(gen, prefix: int, dtype: torch.dtype, cache_dtype: Optional[torch.dtype] = None):
    """A 40-token chunk after `prefix` cached tokens (9 heads over 3 kv heads of 64): its queries, its own K/V as
    the step has them (already written to the cache, as the models do), the caches (in `cache_dtype`, by default
    the step's) and its PrefillChunk."""
    query_len, heads, kv_heads, head_dim = 40, 9, 3, 64
    context = prefix + query_len
    key_cache, value_cache, table = _paged(gen, context, 16, kv_heads, head_dim, cache_dtype or dtype)
    query = torch.randn(query_len, heads, head_dim, generator=gen).to(dtype)
    positions = torch.arange(prefix, context)
    slots = table.long()[positions // 16] * 16 + positions % 16
    key = key_cache.view(-1, kv_heads, head_dim)[slots].to(dtype)
    value = value_cache.view(-1, kv_heads, head_dim)[slots].to(dtype)
    chunk = PrefillChunk(query_start=0, query_len=query_len, context_len=context, block_table=table)
    return query, key, value, key_cache, value_cache, chunk


@pytest.mark.parametrize("prefix", [0, 45])
def test_the_cpu_backend_takes_bf16_chunks_to_it(kernels, prefix):
    """The backend's bf16 chunk comes out as the torch backend's within bf16 tolerance, through the kernel (on
    AMX CPUs through torch's flash attention, which runs on the tiles there)."""
    query, key, value, key_cache, value_cache, chunk = _chunk_of_cache(
        torch.Generator().manual_seed(prefix + 11), prefix, BF16
    )
    backend = CpuAttentionBackend(kernels)
    assert backend._native_prefill(query, key_cache, value_cache) == (not torch_bf16_products_use_amx())
    got = backend._prefill(query, key, value, key_cache, value_cache, chunk, _layer(64))
    expected = TorchAttentionBackend._prefill(query, key, value, key_cache, value_cache, chunk, _layer(64))
    torch.testing.assert_close(got.double(), expected.double(), atol=1.5e-2, rtol=1.5e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float32, BF16, FP8], ids=["float32", "bf16", "fp8"])
@pytest.mark.parametrize("prefix", [0, 45])
def test_the_cpu_backend_takes_float32_chunks_to_it(f32_kernels, prefix, cache_dtype, monkeypatch):
    """float32 chunks over a float32 cache, or a bf16 or fp8 one (a float32 model with --kv-cache-dtype bfloat16
    or fp8), run on the kernel (AMX CPUs too: torch's flash kernel runs float32 on FMAs there) and come out as
    the torch backend's within float32 rounding."""
    calls = []
    serve = f32_kernels.prefill_attention
    monkeypatch.setattr(f32_kernels, "prefill_attention", lambda *a: calls.append(1) or serve(*a))
    gen = torch.Generator().manual_seed(prefix + 12)
    query, key, value, key_cache, value_cache, chunk = _chunk_of_cache(gen, prefix, torch.float32, cache_dtype)
    backend = CpuAttentionBackend(f32_kernels)
    got = backend._prefill(query, key, value, key_cache, value_cache, chunk, _layer(64))
    assert calls == [1]
    expected = TorchAttentionBackend._prefill(query, key, value, key_cache, value_cache, chunk, _layer(64))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_builds_without_avx512_bf16_leave_bf16_chunks_to_torch(cpu_kernels):
    """The -march=haswell build compiles the bf16 kernel's stand-in (the backend never calls it there) and the
    float32 kernel's AVX2 loops; -march=x86-64 (SSE2) has neither."""
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_has(*FLOAT32_TILE_ARCHES["haswell"]):
        pytest.skip("this CPU cannot run -march=haswell code")
    haswell = load_cpu_kernels(arch="haswell")
    assert haswell is not None
    assert not haswell.prefill_attention_serves(BF16, BF16) and not haswell.prefill_attention_serves(BF16, FP8)
    assert all(haswell.prefill_attention_serves(torch.float32, cache) for cache in (torch.float32, BF16, FP8))
    query = torch.randn(4, 2, 64)
    cache = torch.randn(2, 16, 1, 64)
    backend = CpuAttentionBackend(haswell)
    assert not backend._native_prefill(query.bfloat16(), cache.bfloat16(), cache.bfloat16())
    assert backend._native_prefill(query, cache, cache)
    portable = load_cpu_kernels(arch="x86-64")
    assert portable is not None
    pairs = ((BF16, BF16), (torch.float32, torch.float32), (torch.float32, BF16), (torch.float32, FP8))
    assert not any(portable.prefill_attention_serves(q, c) for q, c in pairs)
