"""On a CUDA device (skipped without one): the engine runs there and agrees with the CPU."""

import pytest
import torch

from engine import SamplingParams
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import make_llm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_tiny_model_greedy_on_cuda_matches_cpu(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path, "llama")
    prompts = [[5, 6, 7], list(range(10, 50)), [300] * 17]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    cpu = make_llm(model_dir).generate(prompts, params, use_tqdm=False)
    cuda = make_llm(model_dir, device="cuda").generate(prompts, params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in cuda] == [r.outputs[0].token_ids for r in cpu]


def test_gpu_memory_utilization_sizes_the_cache_after_profiling(tmp_path):
    """The KV cache takes what is left of total x utilization after weights and a profiled max step. (The one
    test sized by a fraction: a tiny model's blocks at 0.1 of a large GPU number in the millions, which the
    block pool holds without an object per block.)"""
    model_dir = make_tiny_model_dir(tmp_path, "llama")
    with make_llm(model_dir, device="cuda", num_blocks=None, gpu_memory_utilization=0.1) as llm:
        _, total = torch.cuda.mem_get_info()
        engine = llm.engine
        assert engine.runner.kv_cache.num_blocks > 0
        assert torch.cuda.memory_reserved() <= 0.1 * total * 1.02
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_decode_graphs_give_the_tokens_of_eager_steps(tmp_path, backend):
    """Decode batches replayed from CUDA graphs (padded to their buckets) vs --enforce-eager, fp32/bf16."""
    model_dir = make_tiny_model_dir(tmp_path, "llama")
    prompts = [list(range(3, 3 + 7 * i)) for i in range(1, 8)]
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True) for i in range(7)]
    tokens = {}
    for eager in (True, False):
        try:
            llm = make_llm(
                model_dir,
                device="cuda",
                dtype="bfloat16",
                attention_backend=backend,
                max_num_seqs=8,
                enforce_eager=eager,
            )
        except ValueError as exc:  # flash-attn not installed, or not for this GPU / block size
            pytest.skip(str(exc))
        assert (llm.engine.runner.cuda_graphs == "off") == eager
        tokens[eager] = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.scheduler.kv_cache_manager.usage == 0
    assert tokens[False] == tokens[True]


def test_an_fp8_cache_on_cuda_matches_the_torch_backend(tmp_path):
    """--kv-cache-dtype fp8 under `auto` on CUDA (flash-attn passed over: it reads no fp8 cache): the triton
    kernels widen e4m3 on the GPU (the conversion instruction from sm_89, integer arithmetic before), eagerly
    and from decode graphs, and give the torch backend's greedy tokens over the same fp8 cache."""
    pytest.importorskip("triton")
    model_dir = make_tiny_model_dir(tmp_path, "llama")
    prompts = [list(range(3, 3 + 7 * i)) for i in range(1, 6)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    settings = dict(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", max_num_seqs=8)
    reference = make_llm(model_dir, attention_backend="torch", enforce_eager=True, **settings)
    expected = [r.outputs[0].token_ids for r in reference.generate(prompts, params, use_tqdm=False)]
    for eager in (True, False):
        llm = make_llm(model_dir, enforce_eager=eager, **settings)
        assert llm.engine.runner.backend.name == "triton"
        assert llm.engine.runner.kv_cache.layers[0][0].dtype == torch.float8_e4m3fn
        assert [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)] == expected
        assert llm.engine.scheduler.kv_cache_manager.usage == 0


def test_decode_graphs_over_long_contexts_with_a_profiled_cache(tmp_path):
    """A graph's block table spans max_model_len (4096: several decode partitions) and a 1500-token prompt
    decodes through the graphs with the tokens of eager steps. The cache is sized by kv_cache_memory: a
    fraction of a large GPU would be millions of a tiny model's blocks."""
    model_dir = make_tiny_model_dir(tmp_path, "llama", max_position_embeddings=4096)
    prompts = [list(range(3, 500)) * 3, [5, 6, 7]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = make_llm(
            model_dir,
            device="cuda",
            dtype="bfloat16",
            attention_backend="triton",
            block_size=16,
            max_model_len=4096,
            max_num_batched_tokens=2048,
            num_blocks=None,
            kv_cache_memory="64MiB",
            enforce_eager=eager,
        )
        tokens[eager] = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert tokens[False] == tokens[True]
