"""Sampler: each parameter changes the choice, seeds reproduce across batches, logprobs are raw."""

from __future__ import annotations

import math
from collections import Counter
from typing import Optional, Sequence

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import engine.sampling.sampler as sampler_module
from engine.sampling.sampler import Sampler, SamplerOutput, prompt_logprobs
from engine.sampling.state import SamplingState
from engine.sampling.params import SamplingParams

EOS = 2
CPU = torch.device("cpu")


def make_state(
    params: Optional[SamplingParams] = None,
    *,
    prompt: Sequence[int] = (),
    output: Optional[list[int]] = None,
    eos: Sequence[int] = (EOS,),
    device: torch.device = CPU,
    **changes,
) -> SamplingState:
    params = params if params is not None else SamplingParams(**changes)
    output = [] if output is None else output
    return SamplingState.create(params, list(prompt), output, frozenset(eos), device)


def sample(logits: torch.Tensor, states: Sequence[SamplingState]) -> list[int]:
    return Sampler()(logits, states).sampled_token_ids


def row(*values: float, vocab: int = 16, fill: float = -5.0) -> torch.Tensor:
    """A [1, vocab] logits row starting with `values`, the rest at `fill`."""
    logits = torch.full((1, vocab), fill)
    logits[0, : len(values)] = torch.tensor(values)
    return logits


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------------- reference


def reference_logits(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """The processed logits of one row [vocab], written plainly (float32, same order of operations)."""
    params, x = state.params, logits.float().clone()
    if len(state.output_token_ids) < params.min_tokens:
        suppressed = set(params.stop_token_ids) | (set() if params.ignore_eos else set(state.eos_token_ids))
        for token_id in suppressed:
            x[token_id] = -math.inf
    for token_id, bias in (params.logit_bias or {}).items():
        x[token_id] += bias
    penalty = torch.tensor(params.repetition_penalty)
    for token_id in set(state.prompt_token_ids) | set(state.output_token_ids):
        x[token_id] = x[token_id] / penalty if x[token_id] > 0 else x[token_id] * penalty
    for token_id, count in Counter(state.output_token_ids).items():
        x[token_id] -= torch.tensor(params.frequency_penalty) * count + params.presence_penalty
    return x


def reference_support(logits: torch.Tensor, state: SamplingState, slack: float = 1e-4) -> set[int]:
    """Tokens with non-zero probability after all filters (ties and rounding counted generously)."""
    params, x = state.params, reference_logits(logits, state).double()
    if params.is_greedy:
        return set(torch.nonzero(x == x.max()).flatten().tolist())
    z = (x - x.max()) / params.temperature
    keep = z > -math.inf
    if params.min_p > 0:
        keep &= z >= math.log(params.min_p) - slack
    if params.top_k is not None and params.top_k < x.numel():
        keep &= z >= z.sort(descending=True).values[params.top_k - 1]
    probs = torch.softmax(z.masked_fill(~keep, -math.inf), dim=-1)
    order = probs.argsort(descending=True)
    exclusive = probs[order].cumsum(0) - probs[order]
    in_nucleus = torch.zeros_like(keep)
    in_nucleus[order] = exclusive < params.top_p + slack
    return set(torch.nonzero(keep & in_nucleus).flatten().tolist())


# ---------------------------------------------------------------------- greedy and filters


def test_all_greedy_is_the_argmax_in_any_dtype():
    torch.manual_seed(0)
    logits = torch.randn(64, 1000)
    states = [make_state(temperature=0.0) for _ in range(64)]
    assert sample(logits, states) == logits.argmax(-1).tolist()
    half = logits.bfloat16()
    assert sample(half, states) == half.argmax(-1).tolist()


def test_the_logits_are_not_modified():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    before = logits.clone()
    states = [
        make_state(temperature=0.7, top_p=0.9, logprobs=2),
        make_state(temperature=1.0, repetition_penalty=1.3, prompt=[1, 2], output=[3]),
        make_state(temperature=0.5, min_p=0.1),
        make_state(temperature=0.0, logit_bias={5: 10.0}),
    ]
    Sampler()(logits, states)
    assert torch.equal(logits, before)


def test_top_k_one_is_greedy_even_at_high_temperature():
    torch.manual_seed(1)
    logits = torch.randn(128, 500)
    hot = [make_state(temperature=50.0) for _ in range(128)]
    assert sum(a != b for a, b in zip(sample(logits, hot), logits.argmax(-1).tolist())) > 100
    top1 = [make_state(temperature=50.0, top_k=1) for _ in range(128)]
    assert sample(logits, top1) == logits.argmax(-1).tolist()


def test_tiny_top_p_picks_the_most_likely_token():
    torch.manual_seed(2)
    logits = torch.randn(128, 500)
    states = [make_state(temperature=50.0, top_p=1e-6) for _ in range(128)]
    assert sample(logits, states) == logits.argmax(-1).tolist()


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize(
    "changes, support",
    [
        ({}, [0, 1, 2, 3]),
        ({"top_k": 2}, [0, 1]),
        ({"top_k": 3}, [0, 1, 2]),
        ({"top_p": 0.7}, [0, 1]),  # exclusive mass before token 2 is 0.8
        ({"top_p": 0.85}, [0, 1, 2]),
        ({"min_p": 0.2}, [0, 1, 2]),  # keeps p >= 0.1
        ({"min_p": 0.5}, [0, 1]),  # keeps p >= 0.25
        ({"top_p": 0.83}, [0, 1, 2]),
        # top-p over what top-k / min-p kept, renormalised: 0.53, 0.32, 0.16 (mass before token 2: 0.84)
        ({"top_k": 3, "top_p": 0.83}, [0, 1]),
        ({"min_p": 0.2, "top_p": 0.83}, [0, 1]),
    ],
)
def test_filters_keep_exactly_their_support_in_proportion(changes, support):
    torch.manual_seed(3)
    logits = PROBS.log().expand(4000, -1)
    state = make_state(temperature=1.0, **changes)
    counts = torch.bincount(torch.tensor(sample(logits, [state] * 4000)), minlength=4).float()
    assert sorted(torch.nonzero(counts).flatten().tolist()) == support
    kept = PROBS[support] / PROBS[support].sum()
    assert chi_square(counts[support], kept) < 25.0


def test_each_row_keeps_its_own_filters_in_a_mixed_batch():
    torch.manual_seed(13)
    logits = torch.randn(1, 300) * 2
    kinds = [{"top_k": 2}, {"top_k": 60}, {"top_p": 0.3}, {"min_p": 0.3}, {"temperature": 0.0}, {"top_k": 1000}]
    states = [make_state(**{"temperature": 1.0, **kind}) for kind in kinds] * 50
    tokens = sample(logits.expand(len(states), -1), states)
    for token, state in zip(tokens, states):
        assert token in reference_support(logits[0], state)
    assert len(set(tokens[1 :: len(kinds)])) > 10  # the top-60 row is not held to the top-2 row's candidates


def test_temperature_shapes_the_distribution():
    torch.manual_seed(4)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    for temperature in (0.5, 0.8, 2.0):
        state = make_state(temperature=temperature)
        tokens = sample(logits.expand(6000, -1), [state] * 6000)
        counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
        assert chi_square(counts, torch.softmax(logits / temperature, -1)) < 30.0  # df 7
        assert chi_square(counts, torch.softmax(logits, -1)) > 100.0


def test_long_nucleus_falls_back_to_more_candidates():
    torch.manual_seed(5)
    vocab = 5000
    logits = torch.randn(1, vocab) * 0.5
    for top_p in (0.3, 0.95):  # nucleus within 2048 / past it
        state = make_state(temperature=1.0, top_p=top_p)
        tokens = sample(logits.expand(200, -1), [state] * 200)
        allowed = reference_support(logits[0], state)
        assert len(allowed) > sampler_module.TOP_P_CANDIDATES
        assert set(tokens) <= allowed
        ranks = logits[0].argsort(descending=True).argsort()
        assert max(ranks[t] for t in tokens) > sampler_module.TOP_P_CANDIDATES


def test_logit_bias_forces_and_forbids_tokens():
    torch.manual_seed(6)
    logits = torch.randn(64, 300)
    forced = [make_state(temperature=1.0, logit_bias={7: 100.0}) for _ in range(64)]
    assert sample(logits, forced) == [7] * 64
    best = logits.argmax(-1).tolist()
    forbidden = [make_state(temperature=0.0, logit_bias={b: -100.0}) for b in best]
    assert all(t != b for t, b in zip(sample(logits, forbidden), best))


# ---------------------------------------------------------------------- penalties and min_tokens


def test_presence_penalty_counts_output_tokens_once():
    logits = row(5.0, 4.8)
    assert sample(logits, [make_state(temperature=0, output=[0])]) == [0]
    assert sample(logits, [make_state(temperature=0, output=[0], presence_penalty=0.5)]) == [1]
    assert sample(logits, [make_state(temperature=0, output=[0, 0, 0], presence_penalty=0.1)]) == [0]
    assert sample(logits, [make_state(temperature=0, prompt=[0], presence_penalty=2.0)]) == [0]


def test_frequency_penalty_grows_with_the_count():
    logits = row(5.0, 4.5, 4.0)
    assert sample(logits, [make_state(temperature=0, output=[0, 1], frequency_penalty=0.3)]) == [0]
    assert sample(logits, [make_state(temperature=0, output=[0, 0, 0, 1], frequency_penalty=0.3)]) == [1]
    assert sample(logits, [make_state(temperature=0, output=[0, 0, 0, 1], presence_penalty=0.3)]) == [0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    assert sample(row(2.0, 1.9), [make_state(temperature=0, prompt=[0])]) == [0]
    assert sample(row(2.0, 1.9), [make_state(temperature=0, prompt=[0], repetition_penalty=1.2)]) == [1]
    negative = row(-1.0, -1.1, fill=-9.0)
    assert sample(negative, [make_state(temperature=0, output=[0], repetition_penalty=1.2)]) == [1]
    assert sample(row(1.0, 1.5), [make_state(temperature=0, prompt=[0], repetition_penalty=0.5)]) == [0]


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    logits = row(0.0, 1.0, 9.0, 0.0, 0.0, 8.0, 0.0, 7.0)  # eos 2 > stop id 5 > token 7
    output: list[int] = []
    state = make_state(temperature=0, min_tokens=2, stop_token_ids=[5], output=output)
    for expected in (7, 7, EOS):
        token = sample(logits, [state])[0]
        assert token == expected
        output.append(token)
    ignoring = make_state(temperature=0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    assert sample(logits, [ignoring]) == [EOS]
    assert sample(row(0.0, 0.0, 0.0, 0.0, 0.0, 8.0, 0.0, 7.0), [ignoring]) == [7]
    sampled = [make_state(temperature=1.0, min_tokens=1, stop_token_ids=[5]) for _ in range(200)]
    assert not {EOS, 5} & set(sample(row(0.0, 0.0, 30.0, 0.0, 0.0, 30.0, vocab=8).expand(200, -1), sampled))


def test_processing_matches_a_plain_reference_over_steps():
    generator = torch.Generator().manual_seed(7)
    vocab = 40
    states = [
        make_state(temperature=0, prompt=[1, 2, 3, 3], presence_penalty=0.7, frequency_penalty=0.4),
        make_state(temperature=0, prompt=[5, 6], repetition_penalty=1.8, logit_bias={9: 1.5, 11: -2.0}),
        make_state(
            temperature=0, prompt=[1], repetition_penalty=0.6, presence_penalty=-0.5, min_tokens=3, stop_token_ids=[4]
        ),
        make_state(temperature=0),
    ]
    for _ in range(12):
        logits = torch.randn(len(states), vocab, generator=generator) * 2
        expected = [int(reference_logits(logits[i], s).argmax()) for i, s in enumerate(states)]
        tokens = sample(logits, states)
        assert tokens == expected
        for state, token in zip(states, tokens):
            state.output_token_ids.append(token)


def test_output_cache_follows_the_live_list():
    output = [3, 3, 4]
    state = make_state(presence_penalty=1.0, output=output)
    assert state.output_ids_tensor(CPU).tolist() == [3, 3, 4]
    output.append(5)
    assert state.output_ids_tensor(CPU).tolist() == [3, 3, 4, 5]
    output[:] = [6]
    assert state.output_ids_tensor(CPU).tolist() == [6]


# ---------------------------------------------------------------------- seeds


def run_seeded(
    target: SamplingState, position: int, num_others: int, steps: int, vocab: int, table_seed: int
) -> list[int]:
    """Generate with `target` at row `position` among random unseeded rows; the target's tokens."""
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(table_seed)) * 1.5
    others = [
        make_state(temperature=0.5 + i % 3, top_p=[1.0, 0.9][i % 2], top_k=[None, 5, 50][i % 3])
        for i in range(num_others)
    ]
    for _ in range(steps):
        states = others[:position] + [target] + others[position:]
        logits = torch.randn(len(states), vocab) * 3
        last = target.output_token_ids[-1] if target.output_token_ids else 0
        logits[position] = table[last]
        target.output_token_ids.append(Sampler()(logits, states).sampled_token_ids[position])
    return list(target.output_token_ids)


SEEDED_KINDS = [
    {"temperature": 1.0},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.2, "top_k": 20, "min_p": 0.01},
    {"temperature": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.1},
]


@pytest.mark.parametrize("kind", SEEDED_KINDS)
def test_a_seeded_request_repeats_whatever_shares_its_batch(kind):
    torch.manual_seed(8)
    runs = [
        run_seeded(make_state(seed=1234, **kind), position, num_others, 12, 64, table_seed=0)
        for position, num_others in ((0, 0), (2, 3), (5, 5))
    ]
    assert all(r == runs[0] for r in runs)
    other_seed = run_seeded(make_state(seed=1235, **kind), 1, 2, 12, 64, table_seed=0)
    assert other_seed != runs[0]


def test_seeded_top_p_does_not_depend_on_the_candidates_other_rows_need():
    vocab = 4096
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)) * 0.7
    results = []
    for neighbour in (None, SamplingParams(top_k=3000), SamplingParams(top_k=40)):
        target = make_state(seed=77, temperature=1.0, top_p=0.9)  # nucleus past the first candidates
        states = [target] + ([] if neighbour is None else [make_state(neighbour)])
        results.append([sample(logits.expand(len(states), -1), states)[0] for _ in range(10)])
    assert results[0] == results[1] == results[2]


def test_children_of_a_seeded_request_differ():
    params = SamplingParams(n=2, seed=5, temperature=1.0)
    first, second = (run_seeded(make_state(params.for_child(i)), 0, 0, 15, 64, 0) for i in range(2))
    assert first != second
    assert first == run_seeded(make_state(params.for_child(0)), 0, 0, 15, 64, 0)


# ---------------------------------------------------------------------- logprobs


def check_logprobs(logits: torch.Tensor, row_index: int, entry, token_id: int, num_top: int) -> None:
    raw = torch.log_softmax(logits.float(), dim=-1)[row_index]
    assert entry.token_id == token_id
    assert abs(entry.logprob - float(raw[token_id])) <= 1e-6
    assert entry.rank == 1 + int((raw > raw[token_id]).sum())
    assert len(entry.top) == min(num_top, raw.numel())
    values, ids = raw.topk(len(entry.top))
    assert [t for t, _ in entry.top] == ids.tolist()
    assert all(abs(v - float(e)) <= 1e-6 for (_, v), e in zip(entry.top, values))
    assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:]))


def logprob_states() -> list[SamplingState]:
    """Five rows: greedy and sampled ones asking 0 to 20 alternatives, and one asking none (row 2)."""
    return [
        make_state(temperature=0.0, logprobs=5),
        make_state(temperature=1.0, top_k=10, logprobs=3, repetition_penalty=1.5, prompt=[1, 2], logit_bias={3: 5}),
        make_state(temperature=1.0),
        make_state(temperature=0.7, top_p=0.8, logprobs=0),
        make_state(temperature=5.0, logprobs=20, presence_penalty=1.0, output=[4, 4]),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_the_raw_log_softmax(dtype):
    torch.manual_seed(10)
    logits = (torch.randn(5, 50) * 3).to(dtype)
    states = logprob_states()
    out = Sampler()(logits, states)
    assert isinstance(out, SamplerOutput)
    assert out.logprobs is not None and out.logprobs[2] is None
    for i, num_top in ((0, 5), (1, 3), (3, 0), (4, 20)):
        check_logprobs(logits, i, out.logprobs[i], out.sampled_token_ids[i], num_top)
    assert out.logprobs[0].rank == 1
    assert Sampler()(logits, [make_state() for _ in range(5)]).logprobs is None


def test_ranks_of_unlikely_tokens():
    torch.manual_seed(11)
    logits = torch.randn(64, 200)
    states = [make_state(temperature=20.0, logprobs=2) for _ in range(64)]
    out = Sampler()(logits, states)
    for i, (entry, token) in enumerate(zip(out.logprobs, out.sampled_token_ids)):
        check_logprobs(logits, i, entry, token, 2)
    assert max(e.rank for e in out.logprobs) > 20


@pytest.mark.parametrize("num_top", [0, 3, 20])
def test_prompt_logprobs(num_top, monkeypatch):
    torch.manual_seed(12)
    logits = torch.randn(9, 12) * 2
    targets = torch.randint(0, 12, (9,))
    entries = prompt_logprobs(logits, targets, num_top)
    assert len(entries) == 9
    for i, entry in enumerate(entries):
        check_logprobs(logits, i, entry, int(targets[i]), num_top)
    monkeypatch.setattr(sampler_module, "PROMPT_LOGPROBS_CHUNK", 30)  # 2 rows at a time
    assert prompt_logprobs(logits, targets, num_top) == entries


# ---------------------------------------------------------------------- property


@st.composite
def sampling_cases(draw):
    vocab = draw(st.integers(2, 300))
    num_rows = draw(st.integers(1, 4))
    token = st.integers(0, vocab - 1)
    states = []
    for _ in range(num_rows):
        params = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 1e-4, 0.3, 1.0, 2.5]) | st.floats(0.0, 3.0)),
            top_p=draw(st.just(1.0) | st.floats(0.01, 1.0)),
            top_k=draw(st.none() | st.integers(1, vocab + 3)),
            min_p=draw(st.just(0.0) | st.floats(0.0, 1.0)),
            presence_penalty=draw(st.just(0.0) | st.floats(-2.0, 2.0)),
            frequency_penalty=draw(st.just(0.0) | st.floats(-2.0, 2.0)),
            repetition_penalty=draw(st.just(1.0) | st.floats(0.5, 2.0)),
            logit_bias=draw(st.none() | st.dictionaries(token, st.floats(-100.0, 100.0), max_size=3)),
            min_tokens=draw(st.integers(0, 3)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(token, max_size=2)),
            seed=draw(st.none() | st.integers(0, 2**40)),
            logprobs=draw(st.none() | st.integers(0, 20)),
        )
        prompt = draw(st.lists(token, max_size=8))
        output = draw(st.lists(token, max_size=8))
        states.append(make_state(params, prompt=prompt, output=output, eos=[min(EOS, vocab - 1)]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(num_rows, vocab, generator=generator) * draw(st.sampled_from([0.1, 1.0, 5.0, 40.0]))
    masked = torch.rand(num_rows, vocab, generator=generator) < draw(st.sampled_from([0.0, 0.5, 0.95]))
    return logits.masked_fill(masked, -math.inf), states


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampling_cases())
def test_sampled_tokens_always_have_nonzero_probability(case):
    logits, states = case
    supports = [reference_support(logits[i], s) for i, s in enumerate(states)]
    assume(all(supports))
    out = Sampler()(logits, states)
    for token, allowed, state in zip(out.sampled_token_ids, supports, states):
        assert 0 <= token < logits.shape[1]
        assert token in allowed, (token, sorted(allowed), state.params)


# ---------------------------------------------------------------------- sync-free (the GPU's way)


SYNC_FREE_KINDS = [
    {"temperature": 0.0, "logprobs": 3},
    {"top_k": 20, "logprobs": 0},
    {"top_p": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    {"min_p": 0.05, "repetition_penalty": 1.3, "logit_bias": {5: 2.0}, "logprobs": 5},
    {"top_k": 50, "top_p": 0.9, "repetition_penalty": 0.8, "seed": 7},
    {"temperature": 0.7, "min_tokens": 3, "stop_token_ids": [9]},
    {"temperature": 0.0, "frequency_penalty": -0.4, "logprobs": 20},
]


@pytest.mark.parametrize("seed", range(4))
def test_sync_free_sampling_gives_the_same_tokens_and_logprobs(seed):
    """The way taken on GPUs (dense penalty counts, full-row ranks, always the draw's fallback), run on
    CPU: the same tokens and logprobs as the CPU's sparse way, row by row, in one mixed batch. Top-p rows
    without top-k sort the whole vocabulary instead of growing candidate sets: their tokens are checked
    against the support of the reference instead (exact ties may break differently)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(SYNC_FREE_KINDS), 3000, generator=generator) * 3
    outputs = [[int(t) for t in torch.randint(0, 3000, (5,), generator=generator)] + [5, 5] for _ in SYNC_FREE_KINDS]
    states = [
        make_state(prompt=[3, 4, 3, 11], output=out, eos=(2,), **{"temperature": 1.0, **kind})
        for kind, out in zip(SYNC_FREE_KINDS, outputs)
    ]
    results = {}
    for sync_free in (False, True):
        torch.manual_seed(100 + seed)  # the unseeded rows' shared draw
        results[sync_free] = Sampler(sync_free=sync_free)(logits, states)
    sparse, dense = results[False], results[True]
    for i, state in enumerate(states):
        open_top_p = state.params.top_p < 1.0 and state.params.top_k is None
        if open_top_p:
            assert dense.sampled_token_ids[i] in reference_support(logits[i], state)
        else:
            assert dense.sampled_token_ids[i] == sparse.sampled_token_ids[i], (i, state.params)
        if state.params.logprobs is not None and not open_top_p:
            assert dense.logprobs[i] == sparse.logprobs[i]
    assert dense.logprobs[2] is None and sparse.logprobs[2] is None


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.4},
        {"repetition_penalty": 0.7, "presence_penalty": 0.2},
        {"frequency_penalty": 0.6},
        {"presence_penalty": -1.0, "frequency_penalty": -0.2},
    ],
)
def test_dense_penalties_match_the_sparse_ones_exactly(penalties):
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)) * 4
    logits[0, 7] = -math.inf
    states = [
        make_state(prompt=[1, 7, 7, 9], output=[7, 3, 3, 3, 60], **penalties),
        make_state(temperature=0.0),
        make_state(prompt=[2], output=[2, 2, 63], **penalties),
    ]
    rows = [0, 2]
    sparse, dense = logits.clone(), logits.clone()
    sampler_module._apply_penalties(sparse, states, rows)
    sampler_module._apply_penalties_dense(dense, states, rows)
    assert torch.equal(sparse, dense)
    assert torch.equal(dense[1], logits[1])
    for r in rows:
        assert torch.equal(dense[r], reference_logits(logits[r], states[r]))


def test_prompt_logprobs_take_the_same_ranks_either_way():
    logits = torch.randn(9, 500, generator=torch.Generator().manual_seed(3)) * 3
    targets = torch.randint(0, 500, (9,), generator=torch.Generator().manual_seed(4))
    raw = torch.log_softmax(logits, -1)
    for sync_free in (False, True):
        found = sampler_module._logprob_tensors(raw, targets, [2] * 9, sync_free)
        entries = sampler_module._logprob_entries(*found, [2] * 9)
        for i, entry in enumerate(entries):
            assert entry.rank == int((raw[i] > raw[i, targets[i]]).sum()) + 1
            assert entry.top == list(zip(raw[i].topk(2).indices.tolist(), raw[i].topk(2).values.tolist()))


# ---------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_keeps_the_same_contract(monkeypatch):
    cuda = torch.device("cuda")
    torch.manual_seed(14)
    logits = torch.randn(6, 3000, device=cuda) * 3

    def states(seeded_row: int) -> list[SamplingState]:
        kinds = [
            {"temperature": 0.0, "logprobs": 3},
            {"top_k": 20},
            {"top_p": 0.8, "presence_penalty": 0.5},
            {"min_p": 0.05, "repetition_penalty": 1.3, "logit_bias": {5: 2.0}},
            {"top_p": 0.99},
        ]
        made = [make_state(output=[1, 2, 2], prompt=[3, 4], device=cuda, **{"temperature": 1.0, **k}) for k in kinds]
        target = make_state(seed=99, temperature=1.0, top_p=0.95, device=cuda)
        return made[:seeded_row] + [target] + made[seeded_row:]

    batch = states(0)
    copies_down = []
    real_to_host = sampler_module.to_host

    def to_host(*tensors):  # the one wait allowed: the results' copy down
        copies_down.append(len(tensors))
        torch.cuda.set_sync_debug_mode("default")
        try:
            return real_to_host(*tensors)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(sampler_module, "to_host", to_host)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any other wait for the device raises
    try:
        out = Sampler()(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert copies_down == [6]  # sampled ids, and the logprob rows' ids, logprobs, ranks, top values, top ids
    cpu_logits = logits.cpu()
    for i, (token, state) in enumerate(zip(out.sampled_token_ids, batch)):
        assert token in reference_support(cpu_logits[i], state, slack=1e-3)
    entry = out.logprobs[1]
    raw = torch.log_softmax(cpu_logits[1], -1)
    assert entry.token_id == int(raw.argmax()) and abs(entry.logprob - float(raw.max())) < 1e-5
    first, later = states(0), states(5)
    moved = torch.cat([logits[1:], logits[:1]])  # the seeded row's logits at row 5
    tokens = [Sampler()(logits, first).sampled_token_ids[0] for _ in range(5)]
    assert [Sampler()(moved, later).sampled_token_ids[5] for _ in range(5)] == tokens
    assert len(set(tokens)) > 1


def test_output_ids_tensor_follows_the_live_list():
    """Grown in place step by step (past its first capacity), rebuilt when the list shrinks (preemption)."""
    output: list[int] = []
    state = SamplingState.create(
        SamplingParams(frequency_penalty=0.5), [1, 2], output, frozenset(), torch.device("cpu")
    )
    for token in range(40):
        output.append(token * 7 % 11)
        if token % 3:  # some steps are skipped: several new tokens at once
            assert state.output_ids_tensor(torch.device("cpu")).tolist() == output
    del output[5:]
    assert state.output_ids_tensor(torch.device("cpu")).tolist() == output


def test_greedy_argmax_matches_torch_on_ties_nans_and_infinities():
    """The CPU greedy choice (numpy's argmax) is torch's: the first of equal maxima, a row's first NaN, +inf over
    any finite value, an all -inf row's first column; non-contiguous or other-dtype rows take torch's own."""
    _argmax = sampler_module._argmax
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(6, 49152, generator=generator)
    x[1, [7, 900, 40000]] = 50.0  # ties
    x[2, [11, 300]] = float("nan")
    x[3, 123] = float("inf")
    x[4] = float("-inf")
    x[5, [5, 6]] = float("inf")
    got = _argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert got[1:].tolist() == [7, 11, 123, 0, 5]
    columns = x[:, ::2]  # not contiguous
    assert _argmax(columns).tolist() == columns.argmax(dim=-1).tolist()
    assert _argmax(x.to(torch.bfloat16)).tolist() == x.to(torch.bfloat16).argmax(dim=-1).tolist()
