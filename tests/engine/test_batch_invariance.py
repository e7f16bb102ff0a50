"""Same request, same output, whatever else is in the batch (README: "Batch invariance").

The same request (greedy, and seeded at temperature > 0) runs alone, then among 1-16
others of other lengths and parameters that join and finish at other times; with a
budget of 32 tokens per step prompts are split into chunks that depend on the others,
and the target's own full prompt blocks are prefix-cache hits after its solo run.

    float32                     tokens equal (the products may differ in the last bits)
    float32, batch_invariant    tokens and logprobs equal, bit for bit
    bfloat16, batch_invariant   tokens and logprobs equal, bit for bit

bfloat16 without batch_invariant promises nothing: on an AVX-512 machine this tiny
model's greedy and seeded outputs diverged in about a quarter of such runs.
The model is the tiny llama with a 1536-wide MLP, so its down projection has the
shape (K = 1536) at which oneDNN's bf16 product rounds one row alone differently
from the same row among others.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.layer_attention import LayerAttention
from engine import SamplingParams
from engine.attention.step_metadata import StepMetadata, step_metadata_for
from engine.attention.invariant_backend import BatchInvariantCpuBackend
from engine.platform import batch_invariant_numerics
from engine.attention.kv_cache import KVCacheSpec
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import assert_idle, make_llm as one_thread_llm


def make_llm(model_dir, **overrides):
    """references.make_llm on the machine's team (not one thread): these tests check the native kernels' work
    split over threads."""
    return one_thread_llm(model_dir, **{"cpu_threads": None, **overrides})


pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODES = [("float32", False), ("float32", True), ("bfloat16", True)]
TARGETS = [(9, 1), (45, 2)]  # (prompt length, seed): 45 > the step budget, chunked even alone
BATCH_SIZES = (1, 4, 16)


def token_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def target_params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True, logprobs=2),
    ]


def others(count: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Other requests: lengths 3-70, greedy / unseeded / seeded, finishing after 4-40 tokens."""
    rng = random.Random(seed)
    kinds = ({"temperature": 0}, {"temperature": 1.0}, {"temperature": 0.7, "top_k": 20, "seed": 5})
    return [
        (
            token_prompt(seed * 100 + i, rng.randint(3, 70)),
            SamplingParams(max_tokens=rng.randint(4, 40), ignore_eos=True, **kinds[i % 3]),
        )
        for i in range(count)
    ]


def run(llm, requests: list[tuple[list[int], SamplingParams]]):
    results = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    assert_idle(llm)
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]


def check_same_output(solo, got, invariant: bool, where: str) -> None:
    assert got[0] == solo[0], f"tokens differ {where}"
    if invariant:
        assert got[1] == solo[1], f"logprobs differ {where}"


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("wide-llama"), "llama", intermediate_size=1536)


@pytest.fixture(scope="module", params=MODES, ids=[f"{d}{'-invariant' if i else ''}" for d, i in MODES])
def mode(request, wide_llama_dir):
    dtype, invariant = request.param
    with make_llm(wide_llama_dir, dtype=dtype, batch_invariant=invariant, max_num_batched_tokens=32) as llm:
        yield llm, invariant  # shut down before the next mode's


@pytest.mark.parametrize("length,seed", TARGETS)
def test_a_request_gives_the_same_output_in_any_batch(mode, length, seed):
    llm, invariant = mode
    target = token_prompt(seed, length)
    for params in target_params():
        (solo,) = run(llm, [(target, params)])
        assert len(solo[0]) == 24
        for count in BATCH_SIZES:
            batch = others(count, seed=count * 7 + seed)
            position = count // 2
            batch.insert(position, (target, params))
            got = run(llm, batch)[position]
            check_same_output(solo, got, invariant, f"beside {count} others ({params.temperature=})")


def test_preemption_and_recompute_give_the_same_output(wide_llama_dir):
    """A pool too small for the batch: requests are preempted and recomputed, the target among them."""
    llm = make_llm(wide_llama_dir, dtype="bfloat16", batch_invariant=True, max_num_batched_tokens=32, num_blocks=40)
    target = token_prompt(3, 30)
    for params in target_params():
        (solo,) = run(llm, [(target, params)])
        before = llm.engine.scheduler.stats().num_preemptions
        batch = others(6, seed=11)
        batch.insert(3, (target, params))
        got = run(llm, batch)[3]
        assert llm.engine.scheduler.stats().num_preemptions > before
        check_same_output(solo, got, True, "after preemptions")


def test_the_option_selects_the_invariant_kernels(mode):
    llm, invariant = mode
    runner = llm.engine.runner
    names = (runner.backend.name, runner.model.linear.name)
    if invariant:
        assert names == ("cpu-batch-invariant", "batch-invariant")
    else:
        assert "batch-invariant" not in names


@pytest.mark.parametrize(
    "device,dtype,backend,message",
    [
        ("cuda", torch.bfloat16, "auto", "CPU only"),
        ("cpu", torch.float16, "auto", "float32 or bfloat16, not float16"),
        ("cpu", torch.float32, "torch", "attention_backend must be auto or cpu, not 'torch'"),
    ],
)
def test_refuses_what_it_cannot_make_invariant(device, dtype, backend, message):
    with pytest.raises(ValueError, match=message):
        batch_invariant_numerics(backend, torch.device(device), dtype)


# ---------------------------------------------------------------------- attention alone


def metadata_for(runs: list[tuple[int, int]], tables: list[list[int]]) -> StepMetadata:
    """Prefill chunks only: runs[i] = (context_len, query_len) of request i, whose blocks are tables[i]."""
    num_tokens = sum(query_len for _, query_len in runs)
    slots = torch.zeros(num_tokens, dtype=torch.int64)  # unused: the cache is filled beforehand
    requests = [(context_len, query_len, table) for (context_len, query_len), table in zip(runs, tables)]
    return step_metadata_for(requests, slots, 0, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_of_a_query_does_not_depend_on_chunks_or_neighbours(cpu_kernels, dtype):
    """A request's 40 queries: one chunk, split 17 + 23, one row each, or beside other chunks: same bits."""
    block_size, kv_heads, heads, head_dim, length = 4, 2, 6, 32, 40
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.randn(64, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(64, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(64, generator=gen)[:10].tolist()
    other = [b for b in range(64) if b not in table][:12]
    queries = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
    spec = KVCacheSpec(1, block_size, kv_heads, head_dim, dtype)
    backend = BatchInvariantCpuBackend(cpu_kernels)

    def attend(runs, tables, query):
        metadata = backend.build_metadata(metadata_for(runs, tables), spec)
        return backend.attend(query, None, None, key_cache, value_cache, metadata, LayerAttention(head_dim**-0.5))

    whole = attend([(length, length)], [table], queries)
    split = torch.cat([attend([(17, 17)], [table], queries[:17]), attend([(length, 23)], [table], queries[17:])])
    rows = torch.cat([attend([(p + 1, 1)], [table], queries[p : p + 1]) for p in range(length)])
    noise = torch.randn(11, heads, head_dim, generator=gen).to(dtype)
    beside = attend([(45, 11), (length, 23)], [other, table], torch.cat([noise, queries[17:]]))[11:]
    assert torch.equal(split, whole) and torch.equal(rows, whole) and torch.equal(beside, whole[17:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_context_decoded_alone_on_two_threads_matches_its_prefill(cpu_kernels, dtype):
    """600 cached tokens, SmolLM2's heads: the last query alone is few work items for 2 threads, where the
    `cpu` backend's kernel splits the sequence into parts; this backend never does, so the row alone and the
    same row at the end of the whole prompt's 600 rows have the same bits."""
    block_size, kv_heads, heads, head_dim, length = 16, 3, 9, 64, 600
    gen = torch.Generator().manual_seed(1)
    key_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(40, generator=gen)[:38].tolist()
    queries = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
    spec = KVCacheSpec(1, block_size, kv_heads, head_dim, dtype)
    backend = BatchInvariantCpuBackend(cpu_kernels)

    def attend(runs, query):
        metadata = backend.build_metadata(metadata_for(runs, [table]), spec)
        return backend.attend(query, None, None, key_cache, value_cache, metadata, LayerAttention(head_dim**-0.5))

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        whole = attend([(length, length)], queries)
        alone = attend([(length, 1)], queries[-1:])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, whole[-1:])
