"""The attention backends (torch; cpu, i.e. the native decode kernel; cpu-batch-invariant, that kernel for
every query) against a naive float64 reference over the paged cache.

Each case builds a step the way engine/runner/model_runner.py does: a flat batch with
decode rows first, then prefill chunks; per-request non-contiguous block tables;
`slot_mapping` for the new tokens, as one StepMetadata; then the backend's
`build_metadata` (the torch one adds its decode mask: 0 up to each decode's context
length, -inf beyond). The reference
reads each request's K/V back token by token through its block table and runs
causal softmax attention in float64.
"""

from __future__ import annotations

import logging

import random
from dataclasses import dataclass

import pytest
import torch

from engine.attention.layer_attention import LayerAttention
from engine.attention import StepMetadata, get_attention_backend
from engine.attention.step_metadata import step_metadata_for
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.invariant_backend import BatchInvariantCpuBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.kv_cache import KVCacheSpec
from tests.engine.paged_steps import slot_of

NUM_KV_HEADS = 2
NUM_BLOCKS = 160
ATOL = RTOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=["torch", "cpu", "cpu-batch-invariant"])
def backend(request, cpu_kernels):
    if request.param == "cpu":
        return CpuAttentionBackend(cpu_kernels)
    if request.param == "cpu-batch-invariant":
        return BatchInvariantCpuBackend(cpu_kernels)
    return TorchAttentionBackend()


@dataclass
class Seq:
    """One request of the step: `context_len` tokens in all, the last `query_len` new this step."""

    context_len: int
    query_len: int
    blocks: list[int]
    keys: torch.Tensor  # [context_len, kv_heads, head_dim]
    values: torch.Tensor
    queries: torch.Tensor  # [query_len, heads, head_dim]
    is_decode: bool  # a decode row (else a prefill chunk, possibly of one token)


@dataclass
class Step:
    seqs: list[Seq]  # decodes first, in batch order
    num_decodes: int
    query: torch.Tensor  # [num_tokens, heads, head_dim]
    key: torch.Tensor  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor
    metadata: StepMetadata
    block_size: int


def make_cache(block_size: int, head_dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Finite garbage everywhere: whatever is not a request's context must be masked out."""
    shape = (NUM_BLOCKS, block_size, NUM_KV_HEADS, head_dim)
    return torch.randn(shape, generator=gen) * 10, torch.randn(shape, generator=gen) * 10


def build_step(
    shapes: list[tuple[int, int, bool]],  # (context_len, query_len, as_decode), decodes first
    block_size: int,
    group: int,
    head_dim: int,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rng: random.Random,
    gen: torch.Generator,
    shared_prefix: dict[int, tuple[int, int]] | None = None,  # seq index -> (owner index, num blocks)
) -> Step:
    """Random K/V/Q per request; the cached prefix goes straight into the cache, the new tokens into the batch."""
    num_heads = NUM_KV_HEADS * group
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)  # non-contiguous, unordered block tables
    seqs: list[Seq] = []
    for i, (context_len, query_len, as_decode) in enumerate(shapes):
        num_blocks = -(-context_len // block_size)
        shared: list[int] = []
        keys = torch.randn(context_len, NUM_KV_HEADS, head_dim, generator=gen)
        values = torch.randn(context_len, NUM_KV_HEADS, head_dim, generator=gen)
        if shared_prefix and i in shared_prefix:
            owner, n = shared_prefix[i]
            shared = seqs[owner].blocks[:n]
            keys[: n * block_size] = seqs[owner].keys[: n * block_size]
            values[: n * block_size] = seqs[owner].values[: n * block_size]
        blocks = shared + [free.pop() for _ in range(num_blocks - len(shared))]
        assert not as_decode or query_len == 1
        seqs.append(
            Seq(
                context_len,
                query_len,
                blocks,
                keys,
                values,
                torch.randn(query_len, num_heads, head_dim, generator=gen),
                as_decode,
            )
        )
        for pos in range(len(shared) * block_size, context_len - query_len):  # the cached prefix (own blocks)
            slot = slot_of(blocks, pos, block_size)
            key_cache.view(-1, NUM_KV_HEADS, head_dim)[slot] = keys[pos]
            value_cache.view(-1, NUM_KV_HEADS, head_dim)[slot] = values[pos]

    num_decodes = sum(1 for s in seqs if s.is_decode)
    assert all(s.is_decode for s in seqs[:num_decodes]), "decodes go first"
    slots, queries, new_keys, new_values = [], [], [], []
    for seq in seqs:
        start = seq.context_len - seq.query_len
        slots.extend(slot_of(seq.blocks, p, block_size) for p in range(start, seq.context_len))
        queries.append(seq.queries)
        new_keys.append(seq.keys[start:])
        new_values.append(seq.values[start:])
    metadata = step_metadata_for(
        [(s.context_len, s.query_len, s.blocks) for s in seqs],
        torch.tensor(slots, dtype=torch.int64),
        num_decodes,
        torch.device("cpu"),
    )
    return Step(seqs, num_decodes, torch.cat(queries), torch.cat(new_keys), torch.cat(new_values), metadata, block_size)


def gather(cache: torch.Tensor, blocks: list[int], length: int) -> torch.Tensor:
    """A request's K or V read token by token through its block table: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    return torch.stack([cache[blocks[p // block_size], p % block_size] for p in range(length)])


def reference_attention(seq: Seq, key_cache, value_cache, scale: float) -> torch.Tensor:
    """Causal softmax attention in float64, GQA by repeating kv heads: [query_len, heads, head_dim]."""
    k = gather(key_cache, seq.blocks, seq.context_len).double()
    v = gather(value_cache, seq.blocks, seq.context_len).double()
    q = seq.queries.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [context_len, heads, head_dim]
    v = v.repeat_interleave(group, dim=1)
    offset = seq.context_len - seq.query_len
    query_pos = torch.arange(offset, seq.context_len)[:, None]  # [query_len, 1]
    visible = torch.arange(seq.context_len)[None, :] <= query_pos  # [query_len, context_len]
    scores = torch.einsum("qhd,thd->hqt", q, k) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqt,thd->qhd", torch.softmax(scores, dim=-1), v)


def run_and_check(step: Step, key_cache, value_cache, head_dim: int, backend) -> None:
    scale = head_dim**-0.5
    spec = KVCacheSpec(1, step.block_size, NUM_KV_HEADS, head_dim, key_cache.dtype)
    metadata = backend.build_metadata(step.metadata, spec)  # what the runner does once per step
    before_k, before_v = key_cache.clone(), value_cache.clone()
    backend.write_kv(step.key, step.value, key_cache, value_cache, metadata)
    check_write(step, before_k, before_v, key_cache, value_cache)
    for seq in step.seqs:  # the cache now holds exactly each request's context
        assert torch.equal(gather(key_cache, seq.blocks, seq.context_len), seq.keys)
        assert torch.equal(gather(value_cache, seq.blocks, seq.context_len), seq.values)

    out = backend.attend(step.query, step.key, step.value, key_cache, value_cache, metadata, LayerAttention(scale))
    assert out.shape == step.query.shape and out.dtype == torch.float32
    row = 0
    for i, seq in enumerate(step.seqs):
        expected = reference_attention(seq, key_cache, value_cache, scale)
        got = out[row : row + seq.query_len].double()
        kind = "decode" if seq.is_decode else "prefill"
        torch.testing.assert_close(
            got,
            expected,
            atol=ATOL,
            rtol=RTOL,
            msg=lambda m: f"request {i} ({kind}, context {seq.context_len}, query {seq.query_len}): {m}",
        )
        row += seq.query_len


def check_write(step: Step, before_k, before_v, key_cache, value_cache) -> None:
    """`write_kv` stores token j at slot_mapping[j] and touches no other slot."""
    head_dim = key_cache.shape[-1]
    slots = step.metadata.slot_mapping
    flat_k = key_cache.view(-1, NUM_KV_HEADS, head_dim)
    flat_v = value_cache.view(-1, NUM_KV_HEADS, head_dim)
    assert torch.equal(flat_k[slots], step.key)
    assert torch.equal(flat_v[slots], step.value)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], before_k.view_as(flat_k)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view_as(flat_v)[untouched])


def random_shapes(rng: random.Random, block_size: int) -> list[tuple[int, int, bool]]:
    """A mixed step: decodes, then continuing chunks, fresh prefills and a one-token chunk."""
    decodes = [(rng.randint(1, 5 * block_size + 3), 1, True) for _ in range(rng.randint(1, 5))]
    decodes.append((1, 1, True))  # the very first token decoded alone
    decodes.append((3 * block_size, 1, True))  # the context ends exactly on a block boundary
    chunks = []
    for _ in range(rng.randint(2, 4)):
        query_len = rng.randint(2, 3 * block_size + 2)
        chunks.append((query_len + rng.randint(1, 4 * block_size), query_len, False))  # continues a prefix
    chunks.append((rng.randint(2, 2 * block_size + 5),) * 2 + (False,))  # fresh prefill
    chunks.append((1, 1, False))  # fresh one-token prefill
    chunks.append((rng.randint(2, 3 * block_size), 1, False))  # one-token chunk over a cached prefix
    rng.shuffle(chunks)
    return decodes + chunks


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_step_matches_reference(block_size, group, head_dim, backend):
    for seed in range(3):
        rng = random.Random(f"{block_size}-{group}-{head_dim}-{seed}")
        gen = torch.Generator().manual_seed(seed)
        key_cache, value_cache = make_cache(block_size, head_dim, gen)
        step = build_step(random_shapes(rng, block_size), block_size, group, head_dim, key_cache, value_cache, rng, gen)
        run_and_check(step, key_cache, value_cache, head_dim, backend)


@pytest.mark.parametrize("head_dim", [16, 64, 80])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_only_step(block_size, head_dim, backend):
    rng = random.Random(block_size)
    gen = torch.Generator().manual_seed(1)
    key_cache, value_cache = make_cache(block_size, head_dim, gen)
    shapes = [(rng.randint(1, 6 * block_size), 1, True) for _ in range(7)]
    step = build_step(shapes, block_size, 3, head_dim, key_cache, value_cache, rng, gen)
    assert step.metadata.num_decodes == step.metadata.num_reqs
    run_and_check(step, key_cache, value_cache, head_dim, backend)


def test_torch_decode_per_kv_head_path(monkeypatch):
    """The torch backend's decode path for models with many KV heads."""
    monkeypatch.setattr(TorchAttentionBackend, "DIAGONAL_MAX_KV_HEADS", 0)
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    key_cache, value_cache = make_cache(4, 16, gen)
    step = build_step([(rng.randint(1, 24), 1, True) for _ in range(7)], 4, 3, 16, key_cache, value_cache, rng, gen)
    run_and_check(step, key_cache, value_cache, 16, TorchAttentionBackend())


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_only_step(block_size, backend):
    rng = random.Random(block_size)
    gen = torch.Generator().manual_seed(2)
    key_cache, value_cache = make_cache(block_size, 64, gen)
    shapes = [(20, 20, False), (37, 9, False), (5, 5, False), (2 * block_size + 1, 1, False)]
    step = build_step(shapes, block_size, 1, 64, key_cache, value_cache, rng, gen)
    assert step.metadata.num_decodes == 0
    run_and_check(step, key_cache, value_cache, 64, backend)


@pytest.mark.parametrize("block_size", [1, 4])
def test_reads_blocks_filled_in_the_same_step(block_size, backend):
    """A prefix-cache hit admitted together with its owner reads blocks the owner writes this step."""
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    key_cache, value_cache = make_cache(block_size, 16, gen)
    shared_blocks = 12 // block_size
    shapes = [(5, 1, True), (12 + 3, 15, False), (12 + 6, 6, False), (12 + 1, 1, False)]
    shared = {2: (1, shared_blocks), 3: (1, shared_blocks)}  # both read the owner's first 12 tokens
    step = build_step(shapes, block_size, 3, 16, key_cache, value_cache, rng, gen, shared_prefix=shared)
    run_and_check(step, key_cache, value_cache, 16, backend)


def test_auto_backend_on_cpu(cpu_kernels):
    """auto takes the native kernels on CPU for the dtypes they serve, the torch backend otherwise."""
    assert get_attention_backend("auto", torch.device("cpu"), torch.float32).name == "cpu"
    assert get_attention_backend("auto", torch.device("cpu"), torch.bfloat16).name == "cpu"
    assert get_attention_backend("auto", torch.device("cpu"), torch.float16).name == "torch"
    assert isinstance(get_attention_backend("torch", torch.device("cpu"), torch.float32), TorchAttentionBackend)
    with pytest.raises(ValueError, match="runs float32/bfloat16 on CPU"):
        get_attention_backend("cpu", torch.device("cpu"), torch.float16)


def test_auto_on_cpu_passes_the_kernels_over_for_a_cache_they_cannot_read(cpu_kernels, caplog):
    """The native kernels read float32, bf16 and fp8 e4m3 caches: for another --kv-cache-dtype (fp8_e5m2, or
    float16) auto takes the torch backend, which reads every one, and says why (tests/server/test_metrics.py
    serves through one)."""
    if cpu_kernels is None:
        pytest.skip("the native CPU kernels do not build here")
    cpu = torch.device("cpu")
    for cache in (None, torch.bfloat16, torch.float8_e4m3fn):
        assert get_attention_backend("auto", cpu, torch.bfloat16, kv_cache_dtype=cache).name == "cpu"
    with caplog.at_level(logging.INFO, logger="engine.attention.backend"):
        assert get_attention_backend("auto", cpu, torch.bfloat16, kv_cache_dtype=torch.float8_e5m2).name == "torch"
        assert get_attention_backend("auto", cpu, torch.float32, kv_cache_dtype=torch.float16).name == "torch"
    assert "auto on CPU: torch (the native kernels do not read a fp8_e5m2 KV cache" in caplog.text
    assert "(the native kernels do not read a float16 KV cache;" in caplog.text


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("no-such-backend", torch.device("cpu"), torch.float32)
