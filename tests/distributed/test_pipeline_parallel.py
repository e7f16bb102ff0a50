"""--pipeline-parallel-size over gloo on CPU: the layers split into stages in real worker processes, each stage's
hidden states sent to the next, the last stage's back to stage 0 (the engine's process), which samples; as many
steps in flight as stages. Greedy tokens identical to one process and logprobs within 1e-5 in float32 (a stage
computes exactly what one process computes for its layers), under chunked prefill, prefix caching, preemption,
prompt logprobs and aborts, alone and with tensor parallelism within each stage; a dead stage fails the engine."""

from __future__ import annotations

import os
import signal
import time

import pytest

from engine import LLM, SamplingParams
from engine.distributed.shm_all_reduce import PeerGoneError
from engine.errors import SettingsConflictError
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import assert_idle
from tests.engine.test_model_equivalence import mixed_prompts
from tests.distributed.stepping import tokens_with_an_abort

pytestmark = pytest.mark.timeout(300)

TINY = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Four layers (two per stage), four query heads over two KV heads (two ranks per stage can split them)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama4"), "llama", num_hidden_layers=4)


def run(model_dir, prompts, params: SamplingParams, **settings):
    """Each prompt's tokens and logprobs, stepping the engine by hand; the most steps that were in flight."""
    with LLM(str(model_dir), **{**TINY, **settings}) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {}
        prompt_logprobs: dict[str, list] = {}
        most_in_flight = 0
        while engine.has_work:
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.logprobs or [])
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
            most_in_flight = max(most_in_flight, engine.steps_in_flight + 1)
        stats = engine.stats()
        assert_idle(llm)
    return tokens, logprobs, prompt_logprobs, stats, most_in_flight


def assert_same(got, expected, abs: float = 1e-5) -> None:
    tokens, logprobs = got[:2]
    assert tokens == expected[0]
    for request_id, values in logprobs.items():
        assert values == pytest.approx(expected[1][request_id], abs=abs)


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)


def test_two_stages_with_chunked_prefill_and_preemption(model_dir):
    prompts = mixed_prompts(21)
    expected = run(model_dir, prompts, GREEDY, num_blocks=20)
    got = run(model_dir, prompts, GREEDY, num_blocks=20, pipeline_parallel_size=2)
    assert got[3].num_preemptions > 0
    assert got[4] == 2  # both stages had a step
    assert_same(got, expected)


def test_prefix_cache_hits(model_dir):
    prompts = mixed_prompts(22, shared_prefix=20)
    expected = run(model_dir, prompts, GREEDY, enable_prefix_caching=True)
    got = run(model_dir, prompts, GREEDY, enable_prefix_caching=True, pipeline_parallel_size=2)
    assert got[3].prefix_cache_hits >= 16
    assert_same(got, expected)


def test_tensor_parallel_within_each_of_two_stages_with_prompt_logprobs(model_dir):
    """Four ranks: stage 0 = ranks 0, 1 and stage 1 = ranks 2, 3, each stage's pair all-reducing between them;
    prompt logprobs make the last stage send every row back, not only the sampled ones."""
    prompts = mixed_prompts(23)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    expected = run(model_dir, prompts, params)
    got = run(model_dir, prompts, params, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert_same(got, expected)
    assert got[2].keys() == expected[2].keys() == {f"r{i}" for i in range(len(prompts))}
    for request_id, scored in got[2].items():
        want = expected[2][request_id]
        assert len(scored) == len(want)
        for entry, want_entry in zip(scored[1:], want[1:]):
            assert entry.token_id == want_entry.token_id
            assert entry.logprob == pytest.approx(want_entry.logprob, abs=1e-5)


def test_aborts_while_steps_are_in_flight(model_dir):
    """A request aborted while its step is in flight: its blocks go back at once (a later step that reuses them
    writes after it in every stage), its late tokens are dropped, the others finish as alone."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = mixed_prompts(24)[:4]
    outputs = {}
    for pp in (1, 2):
        with LLM(str(model_dir), **TINY, pipeline_parallel_size=pp) as llm:
            outputs[pp] = tokens_with_an_abort(llm, prompts, params, abort_at=6)
    aborted = outputs[2].pop("r1", [])
    assert len(aborted) < 12 and aborted == outputs[1]["r1"][: len(aborted)]
    outputs[1].pop("r1")
    assert outputs[2] == outputs[1]


def test_three_stages(tmp_path):
    """Six layers as 2 + 2 + 2. Two steps in flight put each request in a batch of its own where one process
    batches them together: batch-invariant products make a row's result independent of its batch, so the
    comparison sees the stages alone."""
    model = str(make_tiny_model_dir(tmp_path, "llama", num_hidden_layers=6))
    prompts = [[1, 54, 34, 28, 49, 31], [1, 198, 28, 94, 35, 46]]
    settings = dict(batch_invariant=True)
    expected = run(model, prompts, GREEDY, **settings)
    got = run(model, prompts, GREEDY, **settings, pipeline_parallel_size=3)
    assert got[4] == 2  # two requests: one step each in flight
    assert_same(got, expected)


def test_a_dead_stage_fails_the_engine_within_seconds(model_dir):
    """Stage 0 waits for the last stage's hidden states: a killed stage 1 ends that wait with an error (its
    connection closes), not after --distributed-timeout."""
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with LLM(str(model_dir), **TINY, max_model_len=256, pipeline_parallel_size=2) as llm:
        engine = llm.engine
        worker = engine.runner.peers.ranks.processes[0]
        engine.add_request("r0", [5, 6, 7, 8], params)
        engine.step()
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(PeerGoneError, match="the stage on rank 1 is gone") as info:
            for _ in range(1000):
                engine.step()
        assert time.monotonic() - started < 10
        assert "gloo" not in str(info.value) and isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    "arch, settings, message",
    [
        ("gemma2", {}, "not served with pipeline parallelism"),
        ("llama", {"pipeline_parallel_size": 3}, "2 layers, fewer than the stages"),
        (
            "llama",
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "speculative decoding",
        ),
    ],
)
def test_refusals_name_the_combination(tmp_path, arch, settings, message):
    model_dir = make_tiny_model_dir(tmp_path / arch, arch)
    with pytest.raises(SettingsConflictError, match=message):
        LLM(str(model_dir), **TINY, **{"pipeline_parallel_size": 2, **settings})
