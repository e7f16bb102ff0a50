"""Building, caching and loading the native CPU kernels, and their bfloat16 path.

(Their float32 results are checked against the float64 reference, next to the torch
backend, in test_attention.py.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.kernels.cpu import build_library, load_cpu_kernels


def _maps_of(name: str) -> set[str]:
    return {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if name in line}


def test_build_is_cached_per_machine_and_source(cpu_kernels, tmp_path):
    first = build_library(tmp_path)
    stamp = first.stat().st_mtime_ns
    second = build_library(tmp_path)
    assert second == first and second.stat().st_mtime_ns == stamp  # found, not rebuilt
    assert first.parent == tmp_path / "kernels" and first.suffix == ".so"
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no partial builds left behind


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
    expected = cpu_kernels.paged_decode(query.float(), key_cache.float(), value_cache.float(), tables, lens,
                                        head_dim**-0.5)
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

