"""The Triton paged-attention kernels against the float64 reference of tests/engine/test_attention.py.

Steps are built as there (decodes first, then prefill chunks; shuffled, non-contiguous block tables;
a cache full of finite garbage), then handed to the kernels in their varlen form: `cu_seqlens_q`,
`seq_lens`, one int32 block table for the whole batch (padded past every row's blocks). Shapes stay
small: on CPU each kernel program runs through Triton's interpreter, one numpy op at a time.
"""

from __future__ import annotations

import dataclasses
import importlib
import random

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine.attention.kv_cache import as_stored  # noqa: E402
from engine.kernels.triton import paged_attention, paged_decode, paged_prefill, write_kv  # noqa: E402
from engine.kernels.triton.paged_kv import KV_FP8_BITS, KV_FP8_CONVERT, KV_FP8_E5M2, load_kv_for_dot  # noqa: E402
from tests.engine.test_attention import (  # noqa: E402
    NUM_KV_HEADS,
    Step,
    build_step,
    gather,
    make_cache,
    random_shapes,
    reference_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # atol and rtol


@dataclasses.dataclass
class Batch:
    """A step in the kernels' terms, on DEVICE, in the test's dtype."""

    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KVH, D]
    value: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks + extra] int32
    max_query_len: int


def to_batch(
    step: Step,
    key_cache,
    value_cache,
    dtype: torch.dtype,
    extra_blocks: int = 2,
    strided_query: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> Batch:
    """The step's tensors for the kernels; `strided_query` reads Q out of a wider fused projection; the new
    K/V and the caches in `cache_dtype` (by default the query's)."""
    cache_dtype = cache_dtype or dtype
    seqs = step.seqs
    cu = [0]
    for seq in seqs:
        cu.append(cu[-1] + seq.query_len)
    width = max(len(s.blocks) for s in seqs) + extra_blocks
    table = [s.blocks + [0] * (width - len(s.blocks)) for s in seqs]
    query = step.query.to(dtype)
    if strided_query:
        num_tokens, num_heads, head_dim = query.shape
        fused = torch.zeros(num_tokens, num_heads + 2 * NUM_KV_HEADS, head_dim, dtype=dtype)
        fused[:, :num_heads] = query
        query = fused.to(DEVICE)[:, :num_heads]
    return Batch(
        query=query.to(DEVICE),
        key=step.key.to(cache_dtype).to(DEVICE),
        value=step.value.to(cache_dtype).to(DEVICE),
        key_cache=key_cache.to(cache_dtype).to(DEVICE),
        value_cache=value_cache.to(cache_dtype).to(DEVICE),
        slot_mapping=step.metadata.slot_mapping.to(DEVICE),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([s.context_len for s in seqs], dtype=torch.int32, device=DEVICE),
        block_table=torch.tensor(table, dtype=torch.int32, device=DEVICE),
        max_query_len=max(s.query_len for s in seqs),
    )


def write_and_check(step: Step, batch: Batch) -> None:
    """After `write_kv` the cache holds exactly each request's context (in the cache's dtype)."""
    write_kv(batch.key, batch.value, batch.key_cache, batch.value_cache, batch.slot_mapping)
    key_cache, value_cache = as_stored(batch.key_cache.cpu()), as_stored(batch.value_cache.cpu())
    for seq in step.seqs:
        keys, values = (as_stored(x.to(batch.key_cache.dtype)) for x in (seq.keys, seq.values))
        assert torch.equal(gather(key_cache, seq.blocks, seq.context_len), keys)
        assert torch.equal(gather(value_cache, seq.blocks, seq.context_len), values)


def check_output(step: Step, batch: Batch, out: torch.Tensor, scale: float) -> None:
    """Against float64 attention over the caches as the kernels hold them (an fp8 cache widened exactly)."""
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    tol = TOLERANCE[out.dtype]
    key_cache, value_cache = batch.key_cache.cpu().double(), batch.value_cache.cpu().double()
    row = 0
    for i, seq in enumerate(step.seqs):
        seq = dataclasses.replace(seq, queries=seq.queries.to(out.dtype))
        expected = reference_attention(seq, key_cache, value_cache, scale)
        got = out[row : row + seq.query_len].cpu().double()
        kind = "decode" if seq.is_decode else "prefill"
        torch.testing.assert_close(
            got,
            expected,
            atol=tol,
            rtol=tol,
            msg=lambda m: f"request {i} ({kind}, context {seq.context_len}, query {seq.query_len}): {m}",
        )
        row += seq.query_len


def make_step(shapes, block_size: int, group: int, head_dim: int, seed: int, shared_prefix=None):
    rng = random.Random(f"{shapes}-{block_size}-{group}-{head_dim}-{seed}")
    gen = torch.Generator().manual_seed(seed)
    key_cache, value_cache = make_cache(block_size, head_dim, gen)
    step = build_step(
        shapes, block_size, group, head_dim, key_cache, value_cache, rng, gen, shared_prefix=shared_prefix
    )
    return step, key_cache, value_cache


def run_attention(
    step, key_cache, value_cache, head_dim: int, dtype=torch.float32, kernel=None, cache_dtype=None, **kwargs
):
    """write_kv, then `kernel` (paged_attention by default) over the whole batch, against the reference."""
    strided = kwargs.pop("strided_query", False)
    batch = to_batch(step, key_cache, value_cache, dtype, strided_query=strided, cache_dtype=cache_dtype)
    write_and_check(step, batch)
    scale = head_dim**-0.5
    if kernel is paged_decode:
        out = paged_decode(
            batch.query, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens, scale, **kwargs
        )
    elif kernel is paged_prefill:
        out = paged_prefill(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.cu_seqlens_q,
            batch.seq_lens,
            batch.block_table,
            scale,
            batch.max_query_len,
            **kwargs,
        )
    else:
        out = paged_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.cu_seqlens_q,
            batch.seq_lens,
            batch.block_table,
            scale,
            batch.max_query_len,
            **kwargs,
        )
    check_output(step, batch, out, scale)


# --- write_kv ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("block_size", [4, 5, 16])
def test_write_kv_matches_index_copy(block_size, slot_dtype, dtype):
    """Token j lands in slot_mapping[j] (block s // block_size, offset s % block_size), nothing else moves;
    K/V read in place from a fused QKV projection; a negative slot (padding) writes nothing."""
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 3, 80, 9
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    qkv = torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]  # strided views
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[3] = -1
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], key[keep])
    expected_v.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], value[keep])

    key_cache, value_cache = key_cache.to(DEVICE), value_cache.to(DEVICE)
    write_kv(key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(slot_dtype).to(DEVICE))
    assert torch.equal(key_cache.cpu(), expected_k)
    assert torch.equal(value_cache.cpu(), expected_v)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_kv_copies_fp8_bytes(fp8):
    """Into an fp8 cache the kernel copies the bytes of K/V converted by the caller (torch's rounding, the
    other backends'); K/V in another dtype than the cache's are refused."""
    gen = torch.Generator().manual_seed(3)
    shape = (5, 4, 2, 48)
    key_cache = (torch.randn(shape, generator=gen) * 8).to(fp8).to(DEVICE)
    value_cache = (torch.randn(shape, generator=gen) * 8).to(fp8).to(DEVICE)
    key, value = (torch.randn(6, 2, 48, generator=gen) * 100 for _ in range(2))
    slots = torch.tensor([0, 7, 19, -1, 4, 12])
    expected_k, expected_v = as_stored(key_cache.cpu()).clone(), as_stored(value_cache.cpu()).clone()
    keep = slots >= 0
    expected_k.view(-1, 2, 48).index_copy_(0, slots[keep], as_stored(key.to(fp8))[keep])
    expected_v.view(-1, 2, 48).index_copy_(0, slots[keep], as_stored(value.to(fp8))[keep])
    write_kv(key.to(fp8).to(DEVICE), value.to(fp8).to(DEVICE), key_cache, value_cache, slots.to(DEVICE))
    assert torch.equal(as_stored(key_cache.cpu()), expected_k)
    assert torch.equal(as_stored(value_cache.cpu()), expected_v)
    other = torch.float8_e5m2 if fp8 == torch.float8_e4m3fn else torch.float8_e4m3fn
    for wrong in (key, key.to(other)):
        with pytest.raises(ValueError, match="fp8 K/V go to a cache of their dtype"):
            write_kv(wrong.to(DEVICE), value.to(fp8).to(DEVICE), key_cache, value_cache, slots.to(DEVICE))


# --- fp8 caches -------------------------------------------------------------------------------------------

CONVERTS_E4M3 = INTERPRETED or torch.cuda.get_device_capability() >= (8, 9)
"""Whether Triton compiles the e4m3 conversion here (the interpreter emulates it; CUDA from sm_89 on)."""
FORMATS = {
    "e4m3-convert": pytest.param(
        (torch.float8_e4m3fn, KV_FP8_CONVERT),
        marks=pytest.mark.skipif(not CONVERTS_E4M3, reason="Triton compiles no e4m3 conversion before sm_89"),
    ),
    "e4m3-bits": (torch.float8_e4m3fn, KV_FP8_BITS),
    "e5m2": (torch.float8_e5m2, KV_FP8_E5M2),
}
"""A cache's fp8 format and how the kernels widen it (e4m3 both ways fp8_widening may pick)."""


def _widen(codes_ptr, out_ptr, COMPUTE: tl.constexpr, KV_FP8: tl.constexpr):
    lanes = tl.arange(0, 256)
    tile = load_kv_for_dot(codes_ptr + lanes, lanes < 256, COMPUTE, False, KV_FP8)
    tl.store(out_ptr + lanes, tile)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_fp8_code_widens_exactly(dtype, fmt):
    """All 256 codes through the kernels' K/V load, every way, into each query dtype: torch's value, bit for
    bit (e4m3 and e5m2 values are all bf16 and fp16 values; e5m2's infinities included). NaN stays NaN where
    the GPU converts, in integer arithmetic and for e5m2; the interpreter's emulated e4m3 conversion reads
    e4m3's two NaN codes (0x7F, 0xFF) as +-480."""
    if dtype == torch.bfloat16 and INTERPRETED:
        pytest.skip("the interpreter computes no bfloat16: the kernels widen to float32 there (UPCAST)")
    fp8, widening = fmt
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256, dtype=dtype, device=DEVICE)
    triton.jit(_widen)[(1,)](codes.to(DEVICE), out, COMPUTE=TL_DTYPES[dtype], KV_FP8=widening)
    expected = codes.view(fp8).to(dtype)
    nan = torch.isnan(expected)
    assert int(nan.sum()) == (2 if fp8 == torch.float8_e4m3fn else 6)
    got = out.cpu()
    if widening == KV_FP8_CONVERT and INTERPRETED:
        assert got[nan].abs().tolist() == [480.0, 480.0]
    else:
        assert torch.isnan(got[nan]).all()
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(got[~nan].view(bits), expected[~nan].view(bits))


def test_kv_widening_names_how_a_cache_is_read(monkeypatch):
    """kv_widening: a cache in the query's dtype as stored; e5m2 by its shift anywhere; e4m3 by the conversion
    under the interpreter and from sm_89 on, by integer arithmetic on older GPUs (and ROCm)."""
    from engine.kernels.triton import kv_widening
    from engine.kernels.triton.paged_kv import KV_AS_STORED, fp8_widening

    assert kv_widening(torch.zeros(2, 4, dtype=torch.bfloat16)) == KV_AS_STORED
    assert kv_widening(torch.zeros(2, 4, dtype=torch.float8_e5m2)) == KV_FP8_E5M2
    e4m3 = torch.zeros(2, 4, dtype=torch.float8_e4m3fn)
    if INTERPRETED:
        assert kv_widening(e4m3) == KV_FP8_CONVERT
    not_a_kernel = object()  # as a compiled kernel's check would see it: not the interpreter's

    class FakeCuda(torch.Tensor):  # the device question only
        is_cuda = True

    cuda_e4m3 = e4m3.as_subclass(FakeCuda)
    for capability, expected in (((8, 0), KV_FP8_BITS), ((8, 9), KV_FP8_CONVERT), ((9, 0), KV_FP8_CONVERT)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fp8_widening(not_a_kernel, cuda_e4m3) == expected
    assert fp8_widening(not_a_kernel, e4m3) == KV_FP8_BITS  # not CUDA, not interpreted
    with pytest.raises(ValueError, match="KV_FP8_CONVERT or KV_FP8_BITS"):
        fp8_widening(not_a_kernel, e4m3, KV_FP8_E5M2)
    with pytest.raises(ValueError, match="an e5m2 cache widens by KV_FP8_E5M2"):
        fp8_widening(not_a_kernel, torch.zeros(1, dtype=torch.float8_e5m2), KV_FP8_BITS)


def _fp8_settings(fmt: tuple[torch.dtype, int]) -> dict:
    fp8, widening = fmt
    return {"cache_dtype": fp8, "widening": widening if fp8 == torch.float8_e4m3fn else None}


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_cache_mixed_step(dtype, fmt):
    """Decodes and prefill chunks over cached prefixes, K/V in fp8 and the query in the model's dtype."""
    rng = random.Random(21)
    step, key_cache, value_cache = make_step(random_shapes(rng, 4), 4, 3, 64, seed=21)
    run_attention(step, key_cache, value_cache, 64, dtype=dtype, **_fp8_settings(fmt))


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_split_kv_decode(dtype, fmt):
    step, key_cache, value_cache = make_step([(61, 1, True), (16, 1, True), (3, 1, True)], 16, 3, 80, seed=22)
    run_attention(
        step, key_cache, value_cache, 80, dtype=dtype, kernel=paged_decode, partition_size=16, **_fp8_settings(fmt)
    )


# --- decode -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_split_kv_decode(block_size, head_dim):
    """Contexts over several 16-token partitions (and within one, and on a block boundary), GQA group 3."""
    rng = random.Random(block_size * head_dim)
    shapes = [(rng.randint(1, 5 * block_size), 1, True) for _ in range(3)]
    shapes += [(1, 1, True), (2 * block_size, 1, True), (70, 1, True)]
    step, key_cache, value_cache = make_step(shapes, block_size, 3, head_dim, seed=head_dim)
    run_attention(step, key_cache, value_cache, head_dim, kernel=paged_decode, partition_size=16)


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_in_one_partition(group, block_size):
    """paged_attention's decode path (max_query_len 1): every context in one partition, no reduction pass."""
    rng = random.Random(block_size + group)
    shapes = [(rng.randint(1, 40), 1, True) for _ in range(4)] + [(3 * block_size, 1, True)]
    step, key_cache, value_cache = make_step(shapes, block_size, group, 16, seed=group)
    run_attention(step, key_cache, value_cache, 16, strided_query=True)


def test_decode_partitions_from_max_seq_len():
    """Given max_seq_len, the grid covers it rather than the block table's width."""
    step, key_cache, value_cache = make_step([(33, 1, True), (50, 1, True), (7, 1, True)], 4, 2, 64, seed=3)
    run_attention(step, key_cache, value_cache, 64, kernel=paged_decode, partition_size=16, max_seq_len=50)


def test_decode_partitions_grow_past_the_cap():
    from engine.kernels.triton.paged_decode import MAX_PARTITIONS, decode_partitions

    assert decode_partitions(100) == (512, 1)
    assert decode_partitions(512 * MAX_PARTITIONS) == (512, MAX_PARTITIONS)
    assert decode_partitions(512 * MAX_PARTITIONS + 1) == (1024, 33)
    assert decode_partitions(131072) == (2048, 64)
    assert decode_partitions(100, 16) == (16, 7)


def test_decode_over_a_graph_wide_block_table():
    """A CUDA graph's step: the block table as wide as max_model_len (here ~33k tokens: 33 partitions of
    1024), the contexts short; partitions past each context exit, the reduction ignores them."""
    step, key_cache, value_cache = make_step([(33, 1, True), (5, 1, True), (70, 1, True)], 16, 2, 16, seed=9)
    batch = to_batch(step, key_cache, value_cache, torch.float32, strided_query=False)
    write_and_check(step, batch)
    wide = torch.zeros((batch.block_table.shape[0], 2060), dtype=torch.int32)
    wide[:, : batch.block_table.shape[1]] = batch.block_table
    out = paged_decode(batch.query, batch.key_cache, batch.value_cache, wide, batch.seq_lens, 16**-0.5)
    check_output(step, batch, out, 16**-0.5)


def test_paged_attention_dispatch(monkeypatch):
    """max_query_len 1 takes the decode kernel, anything longer the prefill kernel for the whole batch."""
    paged_attention_module = importlib.import_module("engine.kernels.triton.paged_attention")
    calls = []
    for name in ("paged_decode", "paged_prefill"):
        real = getattr(paged_attention_module, name)
        monkeypatch.setattr(
            paged_attention_module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    step, key_cache, value_cache = make_step([(9, 1, True), (4, 1, True)], 4, 2, 16, seed=4)
    run_attention(step, key_cache, value_cache, 16)
    step, key_cache, value_cache = make_step([(9, 1, True), (6, 3, False)], 4, 2, 16, seed=4)
    run_attention(step, key_cache, value_cache, 16)
    assert calls == ["paged_decode", "paged_prefill"]


# --- prefill / extend ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 80])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_step(block_size, group, head_dim):
    """Decodes, chunks continuing a cached prefix, fresh prefills, one-token chunks: one prefill launch."""
    rng = random.Random(f"mixed-{block_size}-{group}-{head_dim}")
    step, key_cache, value_cache = make_step(
        random_shapes(rng, block_size), block_size, group, head_dim, seed=block_size + group
    )
    run_attention(step, key_cache, value_cache, head_dim, strided_query=group == 3)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_over_cached_prefix(block_size, head_dim):
    shapes = [(20, 20, False), (37, 9, False), (5, 5, False), (2 * block_size + 1, 1, False)]
    step, key_cache, value_cache = make_step(shapes, block_size, 1, head_dim, seed=2)
    run_attention(step, key_cache, value_cache, head_dim)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_small_tiles(group):
    """16-row tiles: several query tiles per request (padded rows when the group does not divide 16)
    and several key tiles, crossing blocks of 5."""
    shapes = [(45, 30, False), (23, 23, False), (40, 2, False)]
    step, key_cache, value_cache = make_step(shapes, 5, group, 16, seed=group)
    run_attention(step, key_cache, value_cache, 16, kernel=paged_prefill, block_m=max(16, group), block_n=16)


@pytest.mark.parametrize("block_size", [1, 4])
def test_reads_blocks_filled_in_the_same_step(block_size):
    """A prefix-cache hit admitted with its owner reads blocks the owner's write_kv fills this step."""
    shapes = [(5, 1, True), (12 + 3, 15, False), (12 + 6, 6, False), (12 + 1, 1, False)]
    step, key_cache, value_cache = make_step(
        shapes, block_size, 3, 16, seed=7, shared_prefix={2: (1, 12 // block_size), 3: (1, 12 // block_size)}
    )
    run_attention(step, key_cache, value_cache, 16)


@pytest.mark.parametrize("kernel", [paged_decode, paged_prefill])
def test_never_reads_outside_the_contexts(kernel):
    """A real cache starts as torch.empty: NaN in every slot outside the requests' contexts (and in the blocks
    the table's padding points at) must not reach the output. Head dim 80: the padded lanes of the last
    head would read into the next slot."""
    shapes = (
        [(23, 1, True), (9, 1, True), (40, 1, True)]
        if kernel is paged_decode
        else [(23, 1, True), (30, 12, False), (17, 17, False)]
    )
    step, key_cache, value_cache = make_step(shapes, 4, 2, 80, seed=13)
    used = torch.zeros(key_cache.shape[0] * key_cache.shape[1], dtype=torch.bool)
    for seq in step.seqs:
        used[[seq.blocks[p // 4] * 4 + p % 4 for p in range(seq.context_len)]] = True
    for cache in (key_cache, value_cache):
        cache.view(-1, NUM_KV_HEADS, 80)[~used] = float("nan")
    kwargs = {"partition_size": 16} if kernel is paged_decode else {"block_m": 16, "block_n": 16}
    run_attention(step, key_cache, value_cache, 80, kernel=kernel, **kwargs)


# --- 16-bit inputs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_mixed_step(dtype):
    rng = random.Random(11)
    step, key_cache, value_cache = make_step(random_shapes(rng, 4), 4, 3, 64, seed=11)
    run_attention(step, key_cache, value_cache, 64, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_split_kv_decode(dtype):
    step, key_cache, value_cache = make_step([(61, 1, True), (16, 1, True), (3, 1, True)], 16, 3, 80, seed=12)
    run_attention(step, key_cache, value_cache, 80, dtype=dtype, kernel=paged_decode, partition_size=16)


def test_rejects_mismatched_inputs():
    key_cache = torch.zeros(4, 4, 2, 16)
    q = torch.zeros(3, 4, 16)
    lens = torch.ones(3, dtype=torch.int32)
    table = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="share one"):
        paged_decode(q, key_cache, torch.zeros(4, 4, 2, 32), table, lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode(q.bfloat16(), key_cache, key_cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode(q, key_cache, key_cache, table, lens, 1.0, partition_size=24)
    with pytest.raises(ValueError, match="one query per request"):
        paged_attention(q, key_cache, key_cache, torch.arange(3, dtype=torch.int32), lens[:2], table[:2], 1.0, 1)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill(q, key_cache, key_cache, torch.arange(3, dtype=torch.int32), lens, table, 1.0, 2)
    with pytest.raises(ValueError, match="powers of two"):
        paged_prefill(q, key_cache, key_cache, torch.arange(4, dtype=torch.int32), lens, table, 1.0, 2, block_m=24)


@pytest.mark.parametrize("arch", [90, 80])
def test_the_attention_kernels_compile_for_the_gpus_without_one(compile_ahead_of_time, arch):
    """The interpreter runs Python, not the compiler: the attention kernels as the wrappers launch them (caches
    in the query's dtype and fp8 ones, window/soft-cap/sinks variants, the split-KV reduction, the K/V writes)
    compiled for sm_90 (H100/H200: e4m3 widened by the conversion instruction) and sm_80 (A100: by integer
    arithmetic; Triton compiles no fp8e4nv conversion there), e5m2 by a shift on both, in a process without TRITON_INTERPRET, down to a
    cubin by Triton's own ptxas."""
    compiled = compile_ahead_of_time(arch, "attention")
    widening = KV_FP8_CONVERT if arch >= 89 else KV_FP8_BITS
    expected = {f"decode q bf16 cache u8 kv_fp8 {widening}", f"prefill q fp16 cache u8 kv_fp8 {widening}"}
    assert expected | {f"decode q bf16 cache u8 kv_fp8 {KV_FP8_E5M2}"} <= set(compiled)
    assert len(compiled) == 11
