"""logit_bias, min_tokens and the penalties applied by one native call (csrc/logit_processors.cpp,
`Sampler(native_processors=...)`, what a CPU engine's runner uses): the torch way's logits bit for bit, on this
CPU's build, the AVX2 (haswell) build and the portable (x86-64) one, over random batches, the edges of the
arithmetic and enough ids for the rows to run in parallel; and the same tokens over steps."""

from __future__ import annotations

import math
import random

import pytest
import torch

import engine.sampling.sampler as sampler_module
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Sampler
from tests.engine.cpu_flags import kernels_for
from tests.engine.references import make_llm
from tests.engine.test_sampler import make_state, reference_logits

ARCHES = ["native", "haswell", "x86-64"]


@pytest.fixture(scope="module", params=ARCHES)
def processors(request, cpu_kernels):
    return kernels_for(request.param, cpu_kernels).logit_processors


def processed(states, logits: torch.Tensor, native=None) -> torch.Tensor:
    """The sampler's processed logits of a batch: by the torch way, or by `native`."""
    plan = sampler_module._BatchPlan.build(states, logits.shape[1])
    x = logits.to(torch.float32, copy=True)
    if native is None:
        sampler_module._apply_processors(x, states, plan, sync_free=False)
    else:
        sampler_module._apply_processors_native(x, states, plan, native)
    return x


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit for bit (NaN where NaN, the sign of each zero and infinity)."""
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32))


def random_state(rng: random.Random, vocab: int, prompt_len: int, output_len: int):
    """A row with some of the processors (or none), over ids that repeat."""
    params = {"temperature": rng.choice([0.0, 0.8])}
    if rng.random() < 0.6:
        params["repetition_penalty"] = rng.choice([1.0, 0.7, 1.1, 1.3, 2.5])
    if rng.random() < 0.6:
        params["presence_penalty"] = rng.choice([0.0, -1.5, 0.3, 2.0])
        params["frequency_penalty"] = rng.choice([0.0, -0.7, 0.1, 1.9])
    if rng.random() < 0.3:
        params["logit_bias"] = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randint(1, 5))}
    if rng.random() < 0.2:
        params["min_tokens"] = output_len + 2
        params["max_tokens"] = output_len + 10
        params["stop_token_ids"] = [rng.randrange(vocab)]
    prompt = [rng.randrange(min(vocab, 50)) for _ in range(prompt_len)]  # few distinct ids: repeats
    output = [rng.randrange(vocab) for _ in range(output_len)]
    return make_state(prompt=prompt, output=output, eos=(vocab - 1,), **params)


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_random_batches_match_the_torch_way_bit_for_bit(processors, vocab):
    rng = random.Random(vocab)
    for trial in range(12):
        states = [random_state(rng, vocab, rng.randint(0, 40), rng.randint(0, 60)) for _ in range(rng.randint(1, 9))]
        logits = torch.randn(len(states), vocab, generator=torch.Generator().manual_seed(trial)) * 4
        logits[0, : min(3, vocab)] = torch.tensor([0.0, -0.0, -math.inf][: min(3, vocab)])
        expected = processed(states, logits)
        assert_same_bits(processed(states, logits, processors), expected)
        for i, state in enumerate(states):  # and the plain reference, row by row
            assert_same_bits(expected[i], reference_logits(logits[i], state))


def test_edges_of_the_arithmetic(processors):
    """Zeros, infinities, NaN, a penalty past float32's range (inf, as torch casts it) and penalties whose floats
    are zero though they are not (the torch way applies them: its +0 turns a -0 logit into +0), a frequency
    product that a fused multiply-add would round otherwise, ids repeated many times."""
    vocab = 12
    logits = torch.tensor(
        [[0.0, -0.0, math.inf, -math.inf, math.nan, 3.0, -3.0, 1e-40, -1e-40, 3.4e38, -3.4e38, 0.1]] * 6
    )
    everything = list(range(vocab)) * 3
    states = [
        make_state(temperature=0, prompt=everything, repetition_penalty=1e40),
        make_state(temperature=0, output=everything, repetition_penalty=1e-30),
        make_state(temperature=0, output=[11] * 7 + [5] * 3 + [9], frequency_penalty=0.1, presence_penalty=-0.3),
        make_state(
            temperature=0, output=everything, repetition_penalty=1.7, presence_penalty=2.0, frequency_penalty=2.0
        ),
        make_state(temperature=0, output=[1, 6, 1], presence_penalty=-1e-300, frequency_penalty=-0.0),
        make_state(temperature=0, prompt=[0, 6, 7], output=[1, 6], repetition_penalty=1e-50, frequency_penalty=1e-46),
    ]
    assert_same_bits(processed(states, logits, processors), processed(states, logits))


def test_enough_ids_to_run_the_rows_in_parallel(processors):
    """Rows holding 16,384+ ids between them are split over the threads: each row's result is its own."""
    rng = random.Random(3)
    vocab = 5000
    states = [random_state(rng, vocab, 3000, 2500) for _ in range(8)]
    logits = torch.randn(len(states), vocab, generator=torch.Generator().manual_seed(1))
    assert_same_bits(processed(states, logits, processors), processed(states, logits))


def test_ids_outside_the_vocabulary_are_skipped(cpu_kernels):
    x = torch.zeros(2, 8)
    cpu_kernels.logit_processors(
        x,
        ([0, 5, 1], [3, 1, 99], [1.5, 2.0, 7.0]),  # row 5 and id 99 do not exist
        [1],
        [2.0],
        [1.0],
        [0.0],
        [torch.tensor([-1, 2, 8, 2])],
        [torch.tensor([2, 100, 2])],
    )
    expected = torch.zeros(2, 8)
    expected[0, 3] = 1.5
    expected[1, 2] = -1.0  # 0 * 2 = 0 (repetition), then the presence penalty once
    assert torch.equal(x, expected)


def test_logits_laid_out_otherwise_are_processed_alike(processors):
    """Dense logits that are not row-major (a transpose) are copied row-major before the kernel writes them."""
    logits = torch.randn(300, 3, generator=torch.Generator().manual_seed(2)).t()
    states = [make_state(temperature=0, logit_bias={5: 9.0}), make_state(temperature=0), make_state(temperature=0)]
    native = Sampler(native_processors=processors)
    assert native(logits, states).sampled_token_ids == Sampler()(logits, states).sampled_token_ids
    assert native(logits, states).sampled_token_ids[0] == int(torch.argmax(logits[0] + torch.eye(300)[5] * 9.0))


def test_bad_arguments_are_refused(cpu_kernels):
    x = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.logit_processors(x.double(), ([], [], []), [], [], [], [], [], [])
    with pytest.raises(ValueError, match="every penalty"):
        cpu_kernels.logit_processors(x, ([], [], []), [0], [1.0], [], [], [None], [torch.tensor([1])])
    with pytest.raises(ValueError, match="once"):
        ids = torch.tensor([1])
        cpu_kernels.logit_processors(x, ([], [], []), [0, 0], [1.1] * 2, [0.0] * 2, [0.0] * 2, [None] * 2, [ids] * 2)
    with pytest.raises(ValueError, match="int64"):
        cpu_kernels.logit_processors(x, ([], [], []), [0], [1.0], [1.0], [0.0], [None], [torch.tensor([1.0])])


def test_the_same_tokens_over_steps(processors):
    generator = torch.Generator().manual_seed(5)
    vocab = 40
    torch_way, native = Sampler(), Sampler(native_processors=processors)
    rng = random.Random(9)
    states = [random_state(rng, vocab, 6, 0) for _ in range(6)] + [make_state(temperature=0)]
    twins = [make_state(s.params, prompt=s.prompt_token_ids, output=[], eos=s.eos_token_ids) for s in states]
    for step in range(15):
        logits = torch.randn(len(states), vocab, generator=generator) * 2
        torch.manual_seed(step)
        expected = torch_way(logits, states).sampled_token_ids
        torch.manual_seed(step)
        assert native(logits, twins).sampled_token_ids == expected
        for state, twin, token in zip(states, twins, expected):
            state.output_token_ids.append(token)
            twin.output_token_ids.append(token)


def test_a_cpu_engine_applies_penalties_with_the_kernel(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    try:
        runner = llm.engine.runner
        assert runner.sampler.sampler.native_processors is not None
        params = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.5, frequency_penalty=0.5)
        prompt = [5, 6, 7, 5, 6]
        native_tokens = llm.generate([prompt], [params])[0].outputs[0].token_ids
        runner.sampler.sampler.native_processors = None  # the torch way, on the same engine
        assert llm.generate([prompt], [params])[0].outputs[0].token_ids == native_tokens
        assert len(native_tokens) == 12
    finally:
        llm.shutdown()
