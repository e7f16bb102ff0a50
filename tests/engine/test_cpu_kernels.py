"""Building, caching and loading the native CPU kernels, and their bfloat16 path.

(Their float32 results are checked against the float64 reference, next to the torch
backend, in test_attention.py.)
"""

from __future__ import annotations

import logging
import platform
import re
import threading
from pathlib import Path

import pytest
import torch

from engine.kernels.cpu import build_library, load_cpu_kernels, start_build
from tests.engine.cpu_flags import cpu_has
from tests.engine.non_finite import plant_non_finite


def _maps_of(name: str) -> set[str]:
    return {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if name in line}


def test_build_is_cached_per_machine_and_source(tmp_path, caplog):
    # one small source: the cache and its lock are what is checked here (the whole build is the fixture's)
    sources = ("team_split.cpp",)
    with caplog.at_level(logging.INFO, logger="engine.kernels.cpu"):
        background = start_build(tmp_path, sources=sources)  # as a start does before it reads the model
        first = build_library(tmp_path, sources=sources)  # the load's own call: whichever comes second waits
        background.join()
    # one build between the two; the first start says why it goes quiet, and how long it took
    assert [r.getMessage() for r in caplog.records][0] == "building the native CPU kernels (first start only) ..."
    assert len(caplog.records) == 2
    assert re.fullmatch(r"built the native CPU kernels in \d+\.\d s \(cached in .+\)", caplog.records[1].getMessage())
    caplog.clear()
    stamp = first.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="engine.kernels.cpu"):
        second = build_library(tmp_path, sources=sources)
    assert second == first and second.stat().st_mtime_ns == stamp  # found, not rebuilt
    assert not caplog.records  # a cached build loads silently
    assert first.parent == tmp_path / "kernels" and first.suffix == ".so"
    # no objects or partial builds left behind; the lock file stays (see engine/file_lock.py)
    assert sorted(p.name for p in first.parent.iterdir()) == sorted([first.name, first.with_suffix(".lock").name])


def test_every_file_of_csrc_keys_the_build():
    """A source or header missing from SOURCES / HEADERS would not change the build's cache key when edited: the
    stale library would load."""
    from engine.kernels.cpu import CSRC, HEADERS, SOURCES

    assert {p.name for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")} == {*SOURCES, *HEADERS}


def test_kernels_share_torch_openmp_runtime(cpu_kernels):
    """One OpenMP runtime in the process: the kernels' threads are torch's threads."""
    assert len(_maps_of("libgomp")) == 1


def test_failed_build_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that exists and always fails
    with caplog.at_level(logging.WARNING, logger="engine.kernels.cpu"):
        assert load_cpu_kernels(tmp_path) is None
    assert "native CPU kernels unavailable" in caplog.text and "failed to build" in caplog.text


def test_bfloat16_decode_matches_float32(cpu_kernels):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, heads, head_dim = 40, 16, 2, 6, 64
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    query = torch.randn(5, heads, head_dim, generator=gen).bfloat16()
    tables = torch.randperm(num_blocks, generator=gen)[:30].view(5, 6).int()
    lens = torch.tensor([1, 17, 96, 50, 33], dtype=torch.int32)
    got = cpu_kernels.paged_decode(query, key_cache, value_cache, tables, lens, head_dim**-0.5)
    expected = cpu_kernels.paged_decode(
        query.float(), key_cache.float(), value_cache.float(), tables, lens, head_dim**-0.5
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1e-2)


def test_rejects_what_it_cannot_read(cpu_kernels):
    query = torch.randn(2, 4, 8)
    cache = torch.randn(3, 4, 2, 8)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        cpu_kernels.paged_decode(query, cache, cache, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.paged_decode(query.transpose(0, 1), cache, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.paged_decode(torch.randn(2, 4, 16), cache, cache, tables, lens, 1.0)


def test_per_token_ops_refuse_tensors_off_the_cpu(cpu_kernels):
    """Called eagerly without the dispatcher, the kernels refuse tensors of any other device than the CPU, every
    argument (no pointer of another device reaches native code; meta tensors included)."""
    meta = torch.empty(2, 16, device="meta")
    positions = torch.zeros(2, dtype=torch.int64)
    table = torch.zeros(8, 8)
    with pytest.raises(ValueError, match="add_rms_norm takes CPU tensors"):
        cpu_kernels.add_rms_norm(meta, torch.zeros(2, 16), torch.ones(16), 1e-5)
    with pytest.raises(ValueError, match="add_rms_norm takes CPU tensors"):
        cpu_kernels.add_rms_norm(torch.zeros(2, 16), torch.zeros(2, 16), torch.ones(16, device="meta"), 1e-5)
    with pytest.raises(ValueError, match="rms_norm takes CPU tensors"):
        cpu_kernels.rms_norm(torch.zeros(2, 16), torch.ones(16, device="meta"), 1e-5)
    with pytest.raises(ValueError, match="silu_and_mul takes CPU tensors"):
        cpu_kernels.silu_and_mul(meta)
    with pytest.raises(ValueError, match="rotary_ takes CPU tensors"):
        cpu_kernels.rotary_(meta.view(2, 2, 8), positions, table, table)


# ------------------------------------------------------------------ paged decode against float64, per build
# The kernel's code paths (csrc/paged_decode.cpp): AVX-512 passes of 1-4 query heads of a GQA group
# (larger groups take several passes) for head_dim 64/128/256, in chunks of 16 keys that may span blocks
# and end part-way; the portable loops for any other head_dim and on builds without AVX-512; one thread
# or the whole team (items of (sequence, kv head, pass), so fewer sequences than threads still split;
# with few items per thread, long sequences split into parts merged at the end).
DECODE_ARCHES = {
    "native": (),
    "skylake-avx512": ("avx512f", "avx512bw"),  # AVX-512 without BF16: bf16 widened to float32
    "haswell": ("avx2", "fma"),  # the AVX2 chunks (head_dim 64/128/256), else the portable loops
    "x86-64": (),  # the portable loops, SSE2
}
# head_dim, heads, kv_heads, block_size, context lengths (one per sequence)
DECODE_SHAPES = [
    (64, 9, 3, 16, [150, 1, 17, 33, 16]),  # SmolLM2-135M: a group of 3
    (128, 8, 2, 16, [200, 31]),  # a group of 4
    (256, 4, 4, 8, [5, 40, 9]),  # groups of 1, blocks of 8: chunks span two blocks
    (64, 10, 2, 32, [70, 3]),  # a group of 5: passes of 4 and 1
    (128, 16, 2, 16, [45]),  # a group of 8 (two passes), one sequence
    (64, 14, 2, 5, [23, 1, 11, 64]),  # a group of 7, blocks of 5
    (64, 4, 2, 5, [700, 9]),  # a group of 2, blocks of 5: AVX2 chunks of 125 tokens, not whole eights
    (64, 9, 3, 16, [2000]),  # few items for the threads: the sequence split into parts, then merged
    (64, 9, 3, 16, [150]),  # one sequence for two threads: the portable loops split it from 128 tokens
    (64, 4, 2, 5, [131]),  # ... at whole blocks of 5: a part starts off a multiple of 8
    (128, 8, 2, 16, [700, 3, 300]),  # split too: the 3-token sequence has an empty part
    (48, 6, 2, 16, [23, 50]),  # head_dim outside 64/128/256: the portable loops
    (80, 4, 1, 7, [37]),
    (80, 6, 2, 7, [1500, 2]),  # the portable loops split a long sequence too, blocks of 7
]


@pytest.fixture(scope="module", params=list(DECODE_ARCHES))
def decode_kernels(request, cpu_kernels):
    if request.param == "native":
        return cpu_kernels
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"-march={request.param} is an x86 target")
    if not cpu_has(*DECODE_ARCHES[request.param]):
        pytest.skip(f"this CPU cannot run -march={request.param} code")
    kernels = load_cpu_kernels(arch=request.param)
    assert kernels is not None, f"the -march={request.param} build failed"
    return kernels


def _decode_reference(query, key_cache, value_cache, tables, lens, scale):
    """float64 attention over each sequence's cached tokens, gathered from the same cache."""
    num_seqs, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    out = torch.empty(query.shape, dtype=torch.float64)
    for seq in range(num_seqs):
        n = int(lens[seq])
        blocks = tables[seq, : (n + block_size - 1) // block_size].long()
        k = key_cache[blocks].double().reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, 1)
        v = value_cache[blocks].double().reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, 1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", query[seq].double(), k) * scale, dim=-1)
        out[seq] = torch.einsum("ht,thd->hd", probs, v)
    return out


FP8 = torch.float8_e4m3fn
# the query's (and output's) dtype, the cache's: the model's own, or fp8 (--kv-cache-dtype fp8) under either
DECODE_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, FP8),
    (torch.bfloat16, FP8),
]


@pytest.mark.parametrize("dtype, cache_dtype", DECODE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("head_dim, heads, kv_heads, block_size, lens", DECODE_SHAPES)
def test_paged_decode_matches_float64(decode_kernels, dtype, cache_dtype, head_dim, heads, kv_heads, block_size, lens):
    gen = torch.Generator().manual_seed(head_dim * 100 + heads * 10 + block_size)
    width = max((n + block_size - 1) // block_size for n in lens) + 1  # a spare column
    num_blocks = width * len(lens) + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    # a spread of score magnitudes: the running maximum grows mid-sequence and rescales the sums
    query = (torch.randn(len(lens), heads, head_dim, generator=gen) * 3).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width).int()
    for seq, n in enumerate(lens):
        tables[seq, (n + block_size - 1) // block_size :] = 1 << 30  # never read
    lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split shapes split on any machine
    try:
        got = decode_kernels.paged_decode(query, key_cache, value_cache, tables, lens, scale)
    finally:
        torch.set_num_threads(threads)
    expected = _decode_reference(query, key_cache, value_cache, tables, lens, scale)
    assert got.dtype == dtype and got.shape == query.shape
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding (2^-9) and its sums
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("threads", [3, 16])
@pytest.mark.parametrize("lens", [[200], [130], [70, 300]], ids=str)
def test_paged_decode_on_more_threads_than_sequences_matches_float64(decode_kernels, threads, lens):
    """Fewer sequences than threads: the parts' count rounded to whole items per thread only while each part keeps
    its least tokens, else fewer parts (uneven counts on 3 threads, far more threads than parts on 16)."""
    gen = torch.Generator().manual_seed(threads + len(lens))
    block_size, kv_heads, heads, head_dim = 16, 3, 9, 64
    width = max((n + block_size - 1) // block_size for n in lens)
    key_cache = torch.randn(len(lens) * width + 2, block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(len(lens) * width + 2, block_size, kv_heads, head_dim, generator=gen)
    query = torch.randn(len(lens), heads, head_dim, generator=gen) * 3
    tables = torch.randperm(len(lens) * width + 2, generator=gen)[: len(lens) * width].view(len(lens), width).int()
    context = torch.tensor(lens, dtype=torch.int32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode_kernels.paged_decode(query, key_cache, value_cache, tables, context, 0.125)
    finally:
        torch.set_num_threads(before)
    expected = _decode_reference(query, key_cache, value_cache, tables, context, 0.125)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_paged_decode_window_softcap_and_sinks_match_float64(decode_kernels, split):
    """Every build's loops (the AVX2 chunks among them) with a window whose first visible token lies inside a
    block and off a multiple of 8, soft-capped scores and sinks, split across 2 threads or not."""
    gen = torch.Generator().manual_seed(11)
    block_size, kv_heads, heads, head_dim, window, softcap, scale = 16, 3, 9, 64, 613, 5.0, 0.125
    lens = [1000, 37]
    key_cache = torch.randn(140, block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(140, block_size, kv_heads, head_dim, generator=gen)
    query = torch.randn(len(lens), heads, head_dim, generator=gen) * 3
    sinks = torch.randn(heads, generator=gen)
    tables = torch.randperm(140, generator=gen)[:128].view(2, 64).int()
    context = torch.tensor(lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = decode_kernels.paged_decode(
            query, key_cache, value_cache, tables, context, scale, split, window=window, softcap=softcap, sinks=sinks
        )
    finally:
        torch.set_num_threads(threads)
    for seq, n in enumerate(lens):
        blocks = tables[seq, : (n + block_size - 1) // block_size].long()
        k = key_cache[blocks].double().reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, 1)
        v = value_cache[blocks].double().reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,thd->ht", query[seq].double(), k) * scale
        scores = (softcap * torch.tanh(scores / softcap)).masked_fill(torch.arange(n) <= n - 1 - window, -torch.inf)
        probs = torch.softmax(torch.cat([scores, sinks.double()[:, None]], dim=1), dim=1)[:, :-1]
        expected = torch.einsum("ht,thd->hd", probs, v)
        torch.testing.assert_close(got[seq].double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype, cache_dtype", DECODE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("lens", [[40], [2000], [40, 300]], ids=str)
@pytest.mark.parametrize(
    "case", ["query_nan", "key_nan", "key_inf", "value_nan", "minus_inf_first_chunk", "minus_inf_everywhere"]
)
def test_paged_decode_is_nan_where_float64_is(decode_kernels, dtype, cache_dtype, lens, case):
    """A model's overflow reaches the attention as a NaN or an infinity: the output is NaN exactly where float64
    softmax attention's is (a NaN or +inf score makes its head's softmax NaN, a -inf score weighs 0, a NaN value
    spoils its dim, every score -inf is NaN), never a finite number that would hide the fault from the engine's
    check of the logits; the other heads, dims and sequences keep their values. Unsplit, split across 2 threads,
    and in a batch. (-inf scores: the first 16 tokens', or all of them, for kv head 1's query heads.)"""
    gen = torch.Generator().manual_seed(len(lens) * 7 + lens[0])
    block_size, kv_heads, heads, head_dim, scale = 16, 3, 9, 64, 0.125
    width = max(-(-n // block_size) for n in lens)
    key_cache = torch.randn(width * len(lens) + 2, block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(width * len(lens) + 2, block_size, kv_heads, head_dim, generator=gen)
    query = torch.randn(len(lens), heads, head_dim, generator=gen)
    tables = torch.randperm(width * len(lens) + 2, generator=gen)[: width * len(lens)].view(len(lens), width).int()
    block, slot = tables[0, 1], 2  # sequence 0's token 18, kv head 1 (query heads 3-5), dim 5
    if not case.startswith("minus_inf"):
        plant_non_finite(case, query, key_cache, value_cache, block, slot, nan_row=0, inf_rows=0)
    else:
        blocks = tables[0, : 1 if case == "minus_inf_first_chunk" else None].long()
        key_cache[blocks, :, 1, 5] = torch.inf
        query[0, 3:6, 5] = -1.0
    query, key_cache, value_cache = query.to(dtype), key_cache.to(cache_dtype), value_cache.to(cache_dtype)
    context = torch.tensor(lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = decode_kernels.paged_decode(query, key_cache, value_cache, tables, context, scale).double()
    finally:
        torch.set_num_threads(threads)
    expected = _decode_reference(query, key_cache, value_cache, tables, context, scale)
    nan = expected.isnan()
    # e4m3 stores an infinity as 448
    some_nan = case != "minus_inf_first_chunk" and not (cache_dtype == FP8 and "inf" in case)
    assert nan[0, 3:6].any() == some_nan and not nan[1:].any() and not nan[0, :3].any()
    assert torch.equal(got.isnan(), nan)
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[~nan], expected[~nan], atol=tolerance, rtol=tolerance)


def test_split_decode_repeats_its_bits_around_other_splits(decode_kernels):
    """The split parts' sums live in a buffer each calling thread keeps and grows: split decodes of different
    sizes (1 x 1500 and 1 x 600 tokens on 2 threads, 2 sequences on 16), repeated and run from two Python threads
    at once (the kernel is called without the GIL, so each thread's buffer is its own), give the bits each gives
    alone, close to the float64 reference."""
    gen = torch.Generator().manual_seed(23)
    block_size, kv_heads, heads, head_dim = 16, 3, 9, 64
    key_cache = torch.randn(200, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    value_cache = torch.randn(200, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    query = (torch.randn(2, heads, head_dim, generator=gen) * 3).bfloat16()
    tables = torch.randperm(200, generator=gen)[:196].view(2, 98).int()
    cases = [([1500], 2), ([1560, 700], 16), ([600], 2)]

    def decode(lens: list[int], threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)  # (OpenMP's setting is per calling thread)
        rows = len(lens)
        context = torch.tensor(lens, dtype=torch.int32)
        return decode_kernels.paged_decode(query[:rows], key_cache, value_cache, tables[:rows], context, 0.125)

    before = torch.get_num_threads()
    try:
        alone = [decode(lens, threads) for lens, threads in cases]
        mismatches: list[tuple[int, int]] = []

        def run(offset: int) -> None:
            for i in range(60):
                case = (i + offset) % len(cases)
                if not torch.equal(decode(*cases[case]), alone[case]):
                    mismatches.append((offset, i))

        workers = [threading.Thread(target=run, args=(offset,)) for offset in (0, 1)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        torch.set_num_threads(before)
    assert not mismatches
    for (lens, _), got in zip(cases, alone):
        rows = len(lens)
        context = torch.tensor(lens, dtype=torch.int32)
        expected = _decode_reference(query[:rows], key_cache, value_cache, tables[:rows], context, 0.125)
        torch.testing.assert_close(got.double(), expected, atol=1e-2, rtol=1e-2)


def test_paged_decode_one_thread_matches_the_team(cpu_kernels):
    """Sequences too short to split (on 2 threads, 3 sequences leave no thread without one): work items are
    independent, one thread and the team compute the same bits."""
    gen = torch.Generator().manual_seed(5)
    key_cache = torch.randn(40, 16, 2, 128, generator=gen).bfloat16()
    value_cache = torch.randn(40, 16, 2, 128, generator=gen).bfloat16()
    query = torch.randn(3, 8, 128, generator=gen).bfloat16()
    tables = torch.randperm(40, generator=gen)[:39].view(3, 13).int()
    lens = torch.tensor([200, 7, 150], dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # more threads than sequences would split the longer ones
    try:
        team = cpu_kernels.paged_decode(query, key_cache, value_cache, tables, lens, 0.1)
        torch.set_num_threads(1)
        alone = cpu_kernels.paged_decode(query, key_cache, value_cache, tables, lens, 0.1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(team, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unsplit_decode_of_a_long_sequence_depends_on_nothing_else(decode_kernels, dtype):
    """split=False (batch-invariant mode): a 1000-token sequence alone on 2 threads, on 1 thread, and beside
    3 other sequences gives the same bits (with split=True, alone on 2 threads, it is cut into parts and
    merged: close to the float64 reference, not bit-equal)."""
    gen = torch.Generator().manual_seed(7)
    block_size, kv_heads, heads, head_dim, length = 16, 3, 9, 64, 1000
    key_cache = torch.randn(260, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(260, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    query = (torch.randn(4, heads, head_dim, generator=gen) * 3).to(dtype)
    tables = torch.randperm(260, generator=gen)[:256].view(4, 64).int()
    lens = torch.tensor([length, 900, 333, 1], dtype=torch.int32)
    threads = torch.get_num_threads()

    def decode(rows: int, num_threads: int, split: bool) -> torch.Tensor:
        torch.set_num_threads(num_threads)
        return decode_kernels.paged_decode(
            query[:rows].contiguous(),
            key_cache,
            value_cache,
            tables[:rows].contiguous(),
            lens[:rows].contiguous(),
            0.125,
            split,
        )[0]

    try:
        alone = decode(1, 2, False)
        assert torch.equal(decode(1, 1, False), alone) and torch.equal(decode(4, 2, False), alone)
        parts = decode(1, 2, True)
    finally:
        torch.set_num_threads(threads)
    expected = _decode_reference(query[:1], key_cache, value_cache, tables[:1], lens[:1], 0.125)[0]
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    for got in (alone, parts):
        torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


def test_the_weight_stream_is_prefetched_in_software_except_on_amd_with_avx512(monkeypatch):
    from engine.kernels import cpu

    define = f"-DPAGEDSERVE_GEMV_PREFETCH={cpu.GEMV_PREFETCH_BYTES}"
    avx2, avx512 = "flags\t\t: fpu sse2 avx2 fma f16c", "flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw"
    for vendor, flags, prefetches in (
        ("GenuineIntel", avx512, True),
        ("GenuineIntel", avx2, True),
        ("AuthenticAMD", avx2, True),
        ("AuthenticAMD", avx512, False),
    ):
        monkeypatch.setattr(cpu, "_cpu_vendor", lambda vendor=vendor: vendor)
        monkeypatch.setattr(cpu, "_cpu_flags", lambda flags=flags: flags)
        assert (define in cpu._flags("native")) is prefetches, (vendor, flags)
        assert "-march=native" in cpu._flags("native")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_decode_widens_every_fp8_code_exactly(decode_kernels, dtype):
    _assert_every_fp8_code_widens_exactly(decode_kernels, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_builds_without_vbmi_widen_every_fp8_code_exactly(dtype):
    """The widening by arithmetic (AVX-512 without VBMI) in an AVX512-BF16 build, which also takes it for the V
    key pairs of vdpbf16ps (bf16_pairs; the skylake-avx512 build above has no BF16)."""
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_has("avx512_bf16", "avx512bw"):
        pytest.skip("this CPU cannot run -march=cooperlake code")
    kernels = load_cpu_kernels(arch="cooperlake")
    assert kernels is not None
    _assert_every_fp8_code_widens_exactly(kernels, dtype)


def _assert_every_fp8_code_widens_exactly(decode_kernels, dtype):
    """Each of the 256 e4m3 codes (subnormals, zeros of both signs, +-448, the two NaNs) read as torch's
    float8_e4m3fn reads it, through the kernel's conversions for both query dtypes:
    V: two-token contexts with equal scores (zero keys), one V row holding 64 codes and the other zeros, in
    either order (the first and second key of a P.V pair): the output is half the row, bit for bit.
    K: a zero key and a key whose dim 0 holds the code, the query 1 / its value there: the second key's
    probability is the logistic of ~1 (of 0 for zeros), which one mantissa step of the code moves by ~3%."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    head_dim, block_size = 64, 16
    rows = codes.view(4, head_dim)
    values = torch.zeros(8, block_size, 1, head_dim, dtype=torch.uint8)
    values[:4, 0, 0], values[4:, 1, 0] = rows, rows
    keys = torch.zeros_like(values)
    tables = torch.arange(8, dtype=torch.int32).view(8, 1)
    lens = torch.full((8,), 2, dtype=torch.int32)
    query = torch.ones(8, 1, head_dim, dtype=dtype)
    got = decode_kernels.paged_decode(query, keys.view(FP8), values.view(FP8), tables, lens, 0.125)
    half = rows.view(FP8).double() / 2
    torch.testing.assert_close(got.view(8, head_dim).double(), torch.cat([half, half]), atol=0, rtol=0, equal_nan=True)

    n = codes.numel()
    keys = torch.zeros(n, block_size, 1, head_dim, dtype=torch.uint8)
    keys[:, 1, 0, 0] = codes
    values = torch.zeros(n, block_size, 1, head_dim, dtype=torch.uint8)
    values[:, 1, 0, 1] = 0x38  # 1.0: the output's dim 1 is the second key's probability
    stored = codes.view(FP8).double()
    q0 = torch.where((stored == 0) | stored.isnan(), torch.ones_like(stored), 1 / stored).to(dtype)  # NaN: a NaN key
    query = torch.zeros(n, 1, head_dim, dtype=dtype)
    query[:, 0, 0] = q0
    tables = torch.arange(n, dtype=torch.int32).view(n, 1)
    lens = torch.full((n,), 2, dtype=torch.int32)
    got = decode_kernels.paged_decode(query, keys.view(FP8), values.view(FP8), tables, lens, 1.0)[:, 0, 1]
    expected = torch.sigmoid(q0.double() * stored)
    tolerance = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: the probability rounded for P.V, the output
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=0, equal_nan=True)


def test_fp8_rounding_is_torchs_for_every_bf16_value(cpu_kernels, tmp_path):
    """common.h's float -> e4m3 (the fused decode step's cache write, kv_cache.to_cache's in native code) gives
    torch's float8_e4m3fn bytes for all 65,536 bf16 bit patterns (rounding to nearest even, ties, subnormals,
    saturation at +-448 for large values and infinities, NaN to NaN), and for float32 values on either side of
    each rounding boundary."""
    import ctypes
    import subprocess

    from engine.kernels import cpu

    compiler = cpu.compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    source = tmp_path / "fp8.cpp"
    source.write_text(
        '#include "common.h"\n'
        'extern "C" void round_all(const float* x, uint8_t* out, int64_t n) {\n'
        "    for (int64_t i = 0; i < n; ++i) { pagedserve::Fp8E4M3 code; pagedserve::store(&code, x[i]); "
        "out[i] = code.bits; }\n}\n"
    )
    library = tmp_path / "fp8.so"
    subprocess.run(
        [compiler, *cpu.FLAGS, f"-I{cpu.CSRC}", str(source), "-o", str(library)], check=True, capture_output=True
    )
    bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[codes.isfinite()].unique()
    midpoints = (finite[1:] + finite[:-1]) / 2  # ties: to the even code
    around = torch.cat([midpoints, midpoints.nextafter(torch.tensor(float("inf"))), midpoints.nextafter(-midpoints)])
    values = torch.cat([bf16, around, -around]).contiguous()
    out = torch.empty(values.shape, dtype=torch.uint8)
    ctypes.CDLL(str(library)).round_all(
        ctypes.c_void_p(values.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(values.numel())
    )
    expected = values.to(torch.float8_e4m3fn).view(torch.uint8)
    nan = values.isnan()
    assert torch.equal(out[~nan], expected[~nan])
    assert ((out[nan] & 0x7F) == 0x7F).all()  # a NaN code (its sign is not defined)
