"""On a CUDA device (skipped without one): an engine gives its memory back, and start-up choices that only a
GPU can make (flash-attn's probe, its KV cache dtype) hold there.

The memory checks compare torch's allocator before and after: a second engine in a process (a test suite,
the GPU check, a notebook) profiles whatever the first still holds as "other memory"."""

from __future__ import annotations

import gc

import pytest
import torch

from engine import SamplingParams
from engine.attention import get_attention_backend
from engine.attention.attention_shape import AttentionShape
from engine.attention.probe import probe_backend
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import make_llm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SCRATCH = 1 << 20
"""What may stay allocated: a backend object's own small scratch (flash-attn 2's cumulative KV lengths, a few
hundred bytes) lives as long as the backend, which outlives a shutdown engine's description of itself."""
PROFILED = {"device": "cuda", "dtype": "bfloat16", "num_blocks": None, "gpu_memory_utilization": 0.08}


def settle() -> tuple[int, int]:
    """(allocated, free on the device) once pending work is done and the allocator's cache is returned.
    torch keeps a cuBLAS workspace per stream (through the allocator, up to 32 MiB on Hopper) for the process,
    not for an engine: the measurement clears them, which the engine must not do (another engine's graphs
    may use theirs)."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]


@pytest.fixture
def model_dir(tmp_path):
    return make_tiny_model_dir(tmp_path, "llama")


def test_shutdown_gives_the_memory_back_and_a_second_engine_gets_the_same_cache(model_dir):
    baseline, _ = settle()
    blocks = []
    for _ in range(2):
        with make_llm(model_dir, **PROFILED) as llm:  # CUDA graphs captured (auto backend), cache profiled
            assert torch.cuda.memory_allocated() > baseline
            blocks.append(llm.engine.runner.kv_cache.num_blocks)
            llm.generate([[5, 6, 7], list(range(10, 60))], PARAMS, use_tqdm=False)
        allocated, _ = settle()
        assert allocated - baseline < SCRATCH, f"{(allocated - baseline) / 2**20:.1f} MiB still allocated"
    assert blocks[0] > 0 and abs(blocks[1] - blocks[0]) <= 0.01 * blocks[0]


def test_dropping_the_engine_gives_the_memory_back(model_dir):
    baseline, _ = settle()
    llm = make_llm(model_dir, device="cuda", dtype="bfloat16")
    llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
    enabled = gc.isenabled()
    gc.disable()  # freed by reference counting alone: the engine holds no reference cycle
    try:
        del llm
        allocated, _ = settle()
    finally:
        if enabled:
            gc.enable()
    assert allocated - baseline < SCRATCH


def test_flash_refuses_a_kv_cache_dtype_it_cannot_read_at_build_time(model_dir):
    try:
        get_attention_backend("flash", CUDA, torch.bfloat16, block_size=256, shape=AttentionShape(4, 2, 16))
    except ValueError as exc:
        pytest.skip(f"no flash-attn here: {exc}")
    with pytest.raises(
        ValueError,
        match=r"--kv-cache-dtype float16: the flash \(flash-attn \d\) attention backend "
        r"reads a KV cache of bfloat16",
    ):
        make_llm(
            model_dir,
            device="cuda",
            dtype="bfloat16",
            attention_backend="flash",
            block_size=256,
            kv_cache_dtype="float16",
        )


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("block_size", [16, 256])
def test_auto_picks_a_backend_that_runs_the_configuration(head_dim, block_size, caplog):
    """Whatever the flash-attn release and the GPU accept, `auto` never hands the engine a kernel that fails on
    the model's shape: the chosen backend passes the same probe again, and the log says what was chosen and why."""
    shape = AttentionShape(8, 2, head_dim)
    with caplog.at_level("INFO", logger="engine.attention.backend"):
        backend = get_attention_backend("auto", CUDA, torch.bfloat16, block_size=block_size, shape=shape)
    print(f"head_dim {head_dim}, block {block_size}: {backend.name}; {caplog.text.strip()}")
    assert backend.name.split()[0] in ("flash", "triton")
    assert probe_backend(backend, shape, block_size, torch.bfloat16, CUDA) is None
