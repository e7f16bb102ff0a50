"""Sampled rows drawn by the native kernel (csrc/sample_rows.cpp, `Sampler(native_rows=...)`, what a CPU
engine's runner uses): the same tokens as the torch way for full and top-k rows (the same arithmetic and
uniforms), tokens always inside the reference support, each filter's support in proportion, top-p nuclei past
the torch way's candidate sets, and seeded rows that repeat whatever shares their batch; on this CPU's build,
the AVX2 (haswell) build and the portable (x86-64) one. And prompt logprobs row by row (`row_logprobs`)
against a float64 log-softmax."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

from engine.sampling.params import SamplingParams
import engine.sampling.sampler as sampler_module
from engine.sampling.sampler import TOP_P_CANDIDATES, Sampler, prompt_logprobs
from tests.engine.cpu_flags import kernels_for
from tests.engine.references import make_llm
from tests.engine.test_sampler import (
    PROBS,
    chi_square,
    logprob_states,
    make_state,
    reference_support,
    sampling_cases,
)

ARCHES = ["native", "haswell", "x86-64"]


@pytest.fixture(scope="module", params=ARCHES)
def native(request, cpu_kernels):
    """A sampler drawing its sampled rows with this build's kernel."""
    return Sampler(native_rows=kernels_for(request.param, cpu_kernels).sample_rows)


@pytest.fixture(scope="module")
def native_here(cpu_kernels):
    return Sampler(native_rows=cpu_kernels.sample_rows)


KINDS = [
    {"temperature": 0.7},
    {"temperature": 1.0},
    {"temperature": 1.3, "min_p": 0.05},
    {"temperature": 0.8, "top_k": 40},
    {"temperature": 1.0, "top_k": 20, "top_p": 0.8},
    {"temperature": 0.9, "top_k": 100, "min_p": 0.02},
    {"temperature": 1.0, "top_k": 3000, "top_p": 0.95},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 0.3, "top_p": 0.8, "min_p": 0.01},
    {"temperature": 0.0},  # greedy rows between them: the argmax, as before
    {"temperature": 0.5, "top_k": 1},
]


@pytest.mark.parametrize("vocab", [50, 4099, 49152])
def test_full_and_top_k_rows_draw_the_torch_ways_tokens(native, vocab):
    """The same weights, running sums, nucleus and uniforms as the torch way: the same token, row by row (its
    exponential is the kernel's own, so a draw on a boundary could differ by a rounding: none does here). A
    top-p row without top-k (top-k 3000 over a smaller vocabulary too) whose nucleus outgrows the torch way's
    first TOP_P_CANDIDATES draws among it in column order: a token of that nucleus, not the torch way's."""
    plain = Sampler()
    different = 0
    for seed in range(12):
        logits = torch.randn(len(KINDS), vocab, generator=torch.Generator().manual_seed(seed)) * 3
        logits[1, :7] = -math.inf  # masked tokens (min_tokens, logit_bias) weigh nothing
        states = [make_state(**kind) for kind in KINDS]
        torch.manual_seed(seed)  # the unseeded rows' shared draws
        got = native(logits, states).sampled_token_ids
        torch.manual_seed(seed)
        expected = plain(logits, states).sampled_token_ids
        for row, (token, state) in enumerate(zip(got, states)):
            top_k = state.params.top_k
            support = reference_support(logits[row], state)
            if state.params.top_p < 1.0 and (top_k is None or top_k >= vocab) and len(support) > TOP_P_CANDIDATES:
                assert token in support
            else:
                different += token != expected[row]
    assert different == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampling_cases())
def test_sampled_tokens_always_have_nonzero_probability(native_here, case):
    logits, states = case
    supports = [reference_support(logits[i], s) for i, s in enumerate(states)]
    assume(all(supports))
    out = native_here(logits, states)
    for token, allowed, state in zip(out.sampled_token_ids, supports, states):
        assert 0 <= token < logits.shape[1]
        assert token in allowed, (token, sorted(allowed), state.params)


@pytest.mark.parametrize(
    "changes, support",
    [
        ({}, [0, 1, 2, 3]),
        ({"top_k": 2}, [0, 1]),
        ({"top_p": 0.7}, [0, 1]),  # exclusive mass before token 2 is 0.8
        ({"top_p": 0.85}, [0, 1, 2]),
        ({"min_p": 0.2}, [0, 1, 2]),
        ({"top_k": 3, "top_p": 0.83}, [0, 1]),
        ({"min_p": 0.2, "top_p": 0.83}, [0, 1]),
    ],
)
def test_filters_keep_exactly_their_support_in_proportion(native, changes, support):
    torch.manual_seed(3)
    logits = PROBS.log().expand(4000, -1).contiguous()
    state = make_state(temperature=1.0, **changes)
    counts = torch.bincount(torch.tensor(native(logits, [state] * 4000).sampled_token_ids), minlength=4).float()
    assert sorted(torch.nonzero(counts).flatten().tolist()) == support
    kept = PROBS[support] / PROBS[support].sum()
    assert chi_square(counts[support], kept) < 25.0


def test_a_long_nucleus_is_drawn_in_proportion_over_the_whole_row(native):
    """Top-p without top-k over a nucleus of thousands of tokens (the torch way sorted the whole vocabulary):
    every token inside the reference nucleus, deep ranks reached, and the draws' mass where the weights put it."""
    torch.manual_seed(5)
    vocab = 5000
    logits = torch.randn(1, vocab) * 0.5
    for top_p in (0.3, 0.95):
        state = make_state(temperature=1.0, top_p=top_p)
        tokens = native(logits.expand(4000, -1).contiguous(), [state] * 4000).sampled_token_ids
        allowed = reference_support(logits[0], state)
        assert len(allowed) > TOP_P_CANDIDATES
        assert set(tokens) <= allowed
        ranks = logits[0].argsort(descending=True).argsort()
        assert max(ranks[t] for t in tokens) > TOP_P_CANDIDATES
        # the nucleus's best half by rank against the rest: their probabilities' share, within sampling error
        probs = torch.softmax(logits[0].double(), -1)
        nucleus = torch.tensor(sorted(allowed, key=lambda t: int(ranks[t])))
        best = set(nucleus[: len(nucleus) // 2].tolist())
        share = float(probs[nucleus[: len(nucleus) // 2]].sum() / probs[nucleus].sum())
        observed = sum(t in best for t in tokens) / len(tokens)
        assert abs(observed - share) < 4 * math.sqrt(share * (1 - share) / len(tokens))


def test_edges_fall_where_the_torch_way_puts_them(native):
    inf = math.inf
    logits = torch.tensor(
        [
            [-inf, -inf, 3.0, -inf],  # one finite logit: that token, whatever the filters
            [-inf, -inf, 3.0, -inf],
            [1.0, 1.0, 1.0, 1.0],  # ties: top-k 1 keeps the first
            [0.0, 50.0, -50.0, 0.0],
            [2.0, 1.0, 0.0, -1.0],
            [1.0, 3.0, 2.0, 0.0],  # a top-p of 1e-46 is 0 in float32: the best token alone
            [0.0, inf, 1.0, inf],  # +inf (a penalty's): its first, as torch's fallback takes it
            [0.0, inf, 1.0, inf],
        ]
    )
    states = [
        make_state(temperature=2.0),
        make_state(temperature=1.0, top_p=0.5),
        make_state(temperature=1.0, top_k=1),
        make_state(temperature=0.01, top_p=1e-6),
        make_state(temperature=1.0, min_p=1.0),  # only the best token reaches min_p x p_max
        make_state(temperature=1.0, top_p=1e-46),
        make_state(temperature=1.0),
        make_state(temperature=1.0, top_k=2, top_p=0.5),
    ]
    for _ in range(20):
        assert native(logits, states).sampled_token_ids == [2, 2, 0, 1, 0, 1, 1, 1]


def test_a_non_finite_row_gets_some_token_in_range(native):
    """A NaN or +inf row's token is garbage (the runner fails its request), but never out of range."""
    logits = torch.randn(4, 300)
    logits[0, 5] = math.nan
    logits[1, 9] = math.inf
    logits[2] = math.nan
    logits[3] = -math.inf
    for kind in ({"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.9}, {"temperature": 1.0, "top_k": 5}):
        tokens = native(logits, [make_state(**kind)] * 4).sampled_token_ids
        assert all(0 <= t < 300 for t in tokens)


def test_a_seeded_request_repeats_whatever_shares_its_batch(native):
    vocab = 4096
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)) * 0.7
    for kind in ({"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9}, {"temperature": 1.2, "top_k": 20}):
        results = []
        for neighbour in (None, SamplingParams(top_k=3000), SamplingParams(temperature=0.0)):
            target = make_state(seed=77, **kind)
            states = [target] + ([] if neighbour is None else [make_state(neighbour)])
            rows = []
            for _ in range(6):
                rows.append(native(logits.expand(len(states), -1).contiguous(), states).sampled_token_ids[0])
                target.output_token_ids.append(rows[-1])
            results.append(rows)
        assert results[0] == results[1] == results[2]


def test_a_cpu_engine_samples_with_the_kernel(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    try:
        sampler = llm.engine.runner.sampler.sampler
        assert sampler.native_rows is not None
        params = [SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=3)] * 2
        first, second = llm.generate([[5, 6, 7], [5, 6, 7]], params)
        assert first.outputs[0].token_ids == second.outputs[0].token_ids and len(first.outputs[0].token_ids) == 6
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------- prompt logprobs (row_logprobs)


@pytest.fixture(scope="module", params=ARCHES)
def row_logprobs(request, cpu_kernels):
    return kernels_for(request.param, cpu_kernels).row_logprobs


@pytest.mark.parametrize("vocab, scale", [(12, 2.0), (1000, 1.0), (49152, 3.0), (151936, 5.0)])
@pytest.mark.parametrize("num_top", [0, 3, 20])
def test_prompt_logprobs_match_a_float64_log_softmax(row_logprobs, vocab, scale, num_top):
    """Each row's target logprob, rank and best alternatives against float64 (the sum of exponentials in
    double: closer to it than torch's float log-softmax, which drifts by ~1e-5 over 150,000 columns)."""
    generator = torch.Generator().manual_seed(vocab + num_top)
    logits = torch.randn(40, vocab, generator=generator) * scale
    targets = torch.randint(0, vocab, (40,), generator=generator)
    entries = prompt_logprobs(logits, targets, num_top, row_logprobs)
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, entry in enumerate(entries):
        chosen = raw[i, targets[i]]
        assert entry.token_id == int(targets[i])
        assert abs(entry.logprob - float(chosen)) <= 4e-6
        # the rank counts the columns above the target in float32: those within its rounding may go either way
        assert 1 + int((raw[i] > chosen + 4e-6).sum()) <= entry.rank <= 1 + int((raw[i] > chosen - 4e-6).sum())
        values, ids = raw[i].topk(min(num_top, vocab))
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(abs(v - float(e)) <= 4e-6 for (_, v), e in zip(entry.top, values))
    # as torch's float log-softmax computes them, within its own drift
    for entry, plain in zip(entries, prompt_logprobs(logits, targets, num_top)):
        assert [t for t, _ in entry.top] == [t for t, _ in plain.top]
        assert abs(entry.logprob - plain.logprob) <= 3e-5 and abs(entry.rank - plain.rank) <= 2


@pytest.mark.parametrize("column", [3, 39])
def test_a_row_with_nan_gives_a_nan_logprob_as_torch_does(row_logprobs, column):
    """NaN anywhere in a row, in the vector loops' columns or the scalar tail's (40 = 2 x 16 + 8), makes its
    logprobs NaN, as torch's log-softmax does; the next row keeps its value."""
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(column))
    logits[0, column] = torch.nan
    targets = torch.tensor([0, 0])
    for entries in (prompt_logprobs(logits, targets, 0, row_logprobs), prompt_logprobs(logits, targets, 0)):
        assert math.isnan(entries[0].logprob) and math.isfinite(entries[1].logprob)


def test_prompt_logprobs_in_chunks_and_from_bf16(row_logprobs, monkeypatch):
    logits = (torch.randn(9, 300, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    targets = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(2))
    whole = prompt_logprobs(logits, targets, 4, row_logprobs)
    monkeypatch.setattr(sampler_module, "PROMPT_LOGPROBS_CHUNK", 600)  # 2 rows at a time
    assert prompt_logprobs(logits, targets, 4, row_logprobs) == whole
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, entry in enumerate(whole):
        assert abs(entry.logprob - float(raw[i, targets[i]])) <= 4e-6
        # bf16 logits tie often: the rank counts only the strictly more likely, as torch's does
        assert entry.rank == 1 + int((raw[i] > raw[i, targets[i]]).sum())


def test_a_cpu_engines_prompt_logprobs_come_from_the_kernel(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    try:
        runner = llm.engine.runner
        assert runner._row_logprobs is not None
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
        prompt = [5, 6, 7, 8, 9, 10]
        native = llm.generate([prompt], params)[0].prompt_logprobs
        runner._row_logprobs = None  # the torch way
        plain = llm.generate([prompt], params)[0].prompt_logprobs
        assert native[0] is None and plain[0] is None and len(native) == len(prompt)
        for a, b in zip(native[1:], plain[1:]):
            assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
            assert abs(a.logprob - b.logprob) <= 1e-5
    finally:
        llm.shutdown()


def test_sampled_rows_logprobs_come_from_the_kernel_too(cpu_kernels):
    """Logprob rows (greedy and sampled, 0 to 20 alternatives, beside rows without): the torch way's entries,
    within its float log-softmax's rounding."""
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(21)) * 3
    states = logprob_states()
    native = Sampler(native_rows=cpu_kernels.sample_rows, native_logprobs=cpu_kernels.row_logprobs)
    torch.manual_seed(5)
    got = native(logits, states)
    torch.manual_seed(5)
    expected = Sampler(native_rows=cpu_kernels.sample_rows)(logits, states)  # the torch way's logprobs
    assert got.sampled_token_ids == expected.sampled_token_ids
    assert got.logprobs is not None and expected.logprobs is not None and got.logprobs[2] is None
    for a, b in zip(got.logprobs, expected.logprobs):
        if b is None:
            continue
        assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
        assert abs(a.logprob - b.logprob) <= 1e-5 and all(abs(x[1] - y[1]) <= 1e-5 for x, y in zip(a.top, b.top))
