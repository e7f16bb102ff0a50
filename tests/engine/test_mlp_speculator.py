"""IBM's MLP speculator end to end, on the tiny target and speculators made here
(tests/engine/mlp_speculator_factories.py).

- Every proposal's drafts equal a float64 reference's: the recipe written out (each stage's projection, the
  guessed token's embedding, norm, GELU and head) on the HF target's final hidden state at position n - 2 and
  token n - 1; untied, tied past n_predict, with scale_input, behind vLLM's "speculator." prefix.
- Greedy tokens and logprobs with its drafts equal those without, under chunked prefill and preemption, prefix
  hits and n > 1, aborts and `speculative: false`; afterwards every KV block is free and the proposer holds none.
- A speculator that guesses what a successor target says has its drafts accepted (the state and token read, and
  each stage's offset, line up); read from a model alone, as vLLM reads IBM's accelerators.
- Refusals name what is wrong.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from engine.errors import SettingsConflictError
from tests.engine.eagle_factories import record_proposals
from tests.engine.factories import make_tiny_model_dir
from tests.engine.medusa_factories import successor_target_state
from tests.engine.mlp_speculator_factories import (
    make_mlp_speculator,
    random_speculator_tensors,
    reference_drafts,
    successor_speculator,
)
from tests.engine.references import assert_idle, make_llm
from tests.engine.test_spec_decode import PROMPTS, assert_same, check_aborts_and_an_opted_out_request, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("mlp") / "target", "llama")


@pytest.fixture(scope="module")
def speculator(tmp_path_factory):
    return make_mlp_speculator(tmp_path_factory.mktemp("speculator") / "s", n_predict=4)


def speculator_config(path, k: int = 3) -> dict:
    # every decoding request drafts k each step (no adaptive k, no step-cost model), so every path is taken
    return {
        "method": "mlp_speculator",
        "model": str(path),
        "num_speculative_tokens": k,
        "adaptive": False,
        "step_cost_model": False,
    }


def assert_speculator_idle(llm) -> None:
    assert_idle(llm)
    assert llm.engine.scheduler.proposer.num_requests == 0


VARIANTS = {  # name: (make_mlp_speculator keywords, num_speculative_tokens)
    "untied": ({"n_predict": 3}, 3),
    "tied past n_predict": ({"n_predict": 2, "tied": True}, 4),
    "scale_input": ({"n_predict": 3, "scale_input": True}, 3),
    "vllm prefix": ({"n_predict": 3, "prefix": "speculator."}, 2),
}


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_each_proposal_is_the_reference_speculator(variant, target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    keywords, k = variant
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    tied = keywords.get("tied", False)
    tensors = random_speculator_tensors(keywords["n_predict"], tied=tied, seed=5)
    path = make_mlp_speculator(tmp_path / "s", tensors, **keywords)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with make_llm(target_dir, speculative_config=speculator_config(path, k)) as llm:
        assert llm.engine.runner.draft_features == "final"
        calls = record_proposals(llm)
        run(llm, PROMPTS[:3], params)
        assert_speculator_idle(llm)
    drafted = [(tokens, drafts) for tokens, drafts in calls if drafts]
    assert len(drafted) >= 6 and any(len(d) == k for _, d in drafted)
    reference = dict(n_predict=keywords["n_predict"], tied=tied, scale_input=keywords.get("scale_input", False))
    for tokens, drafts in drafted:
        assert drafts == reference_drafts(target, tensors, tokens, len(drafts), **reference)


SCENARIOS = {
    "default": {},
    "chunked prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "preemption": {"num_blocks": 30},
}


@pytest.mark.parametrize("overrides", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_greedy_output_and_logprobs_equal_those_without_speculation(overrides, target_dir, speculator):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    with make_llm(target_dir, **overrides) as base:
        expected = run(base, PROMPTS, params)
    with make_llm(target_dir, speculative_config=speculator_config(speculator), **overrides) as spec:
        got = run(spec, PROMPTS, params)
        assert spec.engine.stats().speculation.num_draft_tokens > 0
        if "num_blocks" in overrides:
            assert spec.engine.stats().num_preemptions > 0
        assert_speculator_idle(spec)
    assert_same(expected, got)


def test_prefix_hits_n_siblings_aborts_and_a_request_that_opted_out(target_dir, speculator):
    """Later prompts' first 16 tokens come from the prefix cache and n = 3 siblings share their prompt's blocks;
    aborted requests leave the others exact and nothing behind; a `speculative: false` request never drafts."""
    shared = list(range(60, 76))
    prompts = [shared + [3, 4, 5], shared + [9, 8, 7, 6]]
    siblings = SamplingParams(n=3, max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    with make_llm(target_dir) as base:
        expected_siblings = [run(base, [p], siblings) for p in prompts]
        expected = run(base, PROMPTS, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    with make_llm(target_dir, speculative_config=speculator_config(speculator)) as spec:
        for want, prompt in zip(expected_siblings, prompts):
            assert_same(want, run(spec, [prompt], siblings))
        assert spec.engine.stats().prefix_cache_hits > 0
        check_aborts_and_an_opted_out_request(spec, expected, spec.engine.scheduler.proposer._features)
        assert_speculator_idle(spec)


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4}], ids=["", "chunked"])
def test_a_speculator_guessing_a_successor_target_has_its_drafts_accepted(overrides, tmp_path):
    """The target's greedy next token is perm[last token]; the tied stages guess perm of the token they read, so
    stage i drafts token n + i exactly when stage 0 reads token n - 1 and each stage the one before guessed: every
    draft is accepted. Given as a model alone (no method), as vLLM serves IBM's accelerators, and past n_predict."""
    target_dir = make_tiny_model_dir(tmp_path / "target", "llama", num_hidden_layers=1)
    state, perm = successor_target_state(load_file(str(target_dir / "model.safetensors")))
    save_file(state, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    tensors = successor_speculator(state["model.embed_tokens.weight"], perm)
    path = make_mlp_speculator(tmp_path / "s", tensors, n_predict=2, inner=64, tied=True)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with make_llm(target_dir, **overrides) as base:
        expected = run(base, PROMPTS, params)
    for tokens in (want[0][0] for want in expected):  # (the target is the successor it was made to be)
        assert all(b == int(perm[a]) for a, b in zip(tokens, tokens[1:]))
    config = {"model": str(path), "num_speculative_tokens": 4, "adaptive": False, "step_cost_model": False}
    with make_llm(target_dir, speculative_config=config, **overrides) as spec:
        assert spec.engine.config.speculative_config.method == "mlp_speculator"
        got = run(spec, PROMPTS, params)
        stats = spec.engine.stats().speculation
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
        assert_speculator_idle(spec)
    assert_same(expected, got)


def test_bfloat16_runs(target_dir, speculator):
    """In bfloat16 (the cpu backend's fused decode step, whose final hidden states the speculator reads)."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with make_llm(target_dir, dtype="bfloat16", speculative_config=speculator_config(speculator)) as spec:
        results = spec.generate([PROMPTS[0]], params, use_tqdm=False)
        assert len(results[0].outputs[0].token_ids) == 12
        assert spec.engine.stats().speculation.num_draft_tokens > 0
        assert_speculator_idle(spec)


def test_refusals_name_what_is_wrong(target_dir, tmp_path):
    def refused(config, match):
        with pytest.raises((SettingsConflictError, ValueError), match=match):
            make_llm(target_dir, speculative_config=config)

    def speculator_with(name, tensors=None, **keys):
        return make_mlp_speculator(tmp_path / name, tensors, **{"n_predict": 3, **keys})

    refused({"method": "mlp_speculator", "num_speculative_tokens": 2}, 'needs "model"')
    refused(speculator_config(speculator_with("few"), k=4), "num_speculative_tokens 4 is more than its 3 stages")
    tensors = random_speculator_tensors(3)
    del tensors["head.2.weight"]
    refused(speculator_config(speculator_with("lacks", tensors)), r"lacks head\.2\.weight")
    tensors = random_speculator_tensors(3)
    tensors["proj.1.weight"] = torch.zeros(48, 64)
    refused(speculator_config(speculator_with("misshapen", tensors)), r"proj\.1\.weight is \[48, 64\]; \[48, 48\]")
    refused(speculator_config(speculator_with("wide", emb_dim=96)), "96-wide states")
    refused(
        speculator_config(speculator_with("vocab", vocab_size=600)), "vocabulary is 600 tokens; the target's is 512"
    )
    tensors = {**random_speculator_tensors(3), "head.0.bias": torch.zeros(512)}
    refused(speculator_config(speculator_with("bias", tensors)), r"not read: head\.0\.bias")
    tensors = random_speculator_tensors(2, tied=True)
    tensors["emb.1.weight"] = torch.zeros(512, 48)  # a repeat of a tied stage's tensor that is not one
    refused(
        speculator_config(speculator_with("untied", tensors, n_predict=2, tied=True), k=2),
        r"emb\.1\.weight differs from emb\.0\.weight",
    )
    broken = speculator_with("broken")
    (broken / "config.json").write_text("{not json")
    refused(speculator_config(broken), "MLP speculator .* cannot be read")
    refused({**speculator_config(speculator_with("tp")), "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size")
