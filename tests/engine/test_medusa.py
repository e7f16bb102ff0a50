"""Medusa speculation end to end, on the tiny target and heads made here (tests/engine/medusa_factories.py).

- Every proposal's drafts equal a float64 reference's: the recipe written out (residual SiLU blocks, each head's
  LM head) on the HF target's final hidden state at position n - 2; in vLLM's layout, the Medusa authors', with a
  truncated vocabulary (token_map) and with the target's LM head shared by every head (original_lm_head).
- Greedy tokens and logprobs with the heads' drafts equal those without, under chunked prefill, preemption,
  prefix-cache hits and n > 1, aborts and `speculative: false`; afterwards every KV block is free and the proposer
  holds no request.
- Heads that guess what a successor target (its next token a function of the last) says have their drafts
  accepted (the position read and each head's offset line up).
- Refusals name what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from engine.errors import SettingsConflictError
from tests.engine.eagle_factories import record_proposals
from tests.engine.factories import make_tiny_model_dir
from tests.engine.medusa_factories import (
    make_medusa_heads,
    random_medusa_tensors,
    reference_drafts,
    successor_heads,
    successor_target_state,
)
from tests.engine.references import assert_idle, make_llm
from tests.engine.test_spec_decode import PROMPTS, assert_same, check_aborts_and_an_opted_out_request, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("medusa") / "target", "llama")


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> Path:
    return make_medusa_heads(tmp_path_factory.mktemp("heads") / "medusa", num_heads=4, num_layers=2, seed=1)


def medusa_config(heads: Path, k: int = 3) -> dict:
    # every decoding request drafts k each step (no adaptive k, no step-cost model), so every path is taken
    return {
        "method": "medusa",
        "model": str(heads),
        "num_speculative_tokens": k,
        "adaptive": False,
        "step_cost_model": False,
    }


def assert_heads_idle(llm) -> None:
    assert_idle(llm)
    assert llm.engine.scheduler.proposer.num_requests == 0


def _variant(kind: str, root: Path):
    """(heads dir, reference keywords: tensors, token_map, shared_lm_head) of each checkpoint layout."""
    tensors = random_medusa_tensors(3, 2, seed=3)
    if kind == "vllm":
        return make_medusa_heads(root, tensors, num_heads=3, num_layers=2), {"tensors": tensors}
    if kind == "authors":
        return make_medusa_heads(root, tensors, num_heads=3, num_layers=2, authors=True), {"tensors": tensors}
    if kind == "token_map":
        token_map = torch.sort(torch.randperm(512, generator=torch.Generator().manual_seed(4))[:200]).values
        tensors["token_map"] = token_map
        tensors["lm_heads.1.weight"] = tensors["lm_heads.1.weight"][token_map]  # stored truncated; the others whole
        path = make_medusa_heads(root, tensors, num_heads=3, num_layers=2, truncated_vocab_size=200)
        return path, {"tensors": tensors, "token_map": token_map}
    for i in range(3):
        del tensors[f"lm_heads.{i}.weight"]
    path = make_medusa_heads(root, tensors, num_heads=3, num_layers=2, original_lm_head=True)
    return path, {"tensors": tensors, "shared_lm_head": "target"}


@pytest.mark.parametrize("kind", ["vllm", "authors", "token_map", "target_lm_head"])
def test_each_proposal_is_the_reference_heads(kind, target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    path, reference = _variant(kind, tmp_path / kind)
    if reference.get("shared_lm_head") == "target":
        reference["shared_lm_head"] = target.lm_head.weight
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with make_llm(target_dir, speculative_config=medusa_config(path)) as llm:
        assert llm.engine.runner.draft_features == "final"
        calls = record_proposals(llm)
        run(llm, PROMPTS[:3], params)
        assert_heads_idle(llm)
    drafted = [(tokens, drafts) for tokens, drafts in calls if drafts]
    assert len(drafted) >= 6 and any(len(d) == 3 for _, d in drafted)
    for tokens, drafts in drafted:
        assert drafts == reference_drafts(target, k=len(drafts), token_ids=tokens, **reference)


def test_heads_sharing_a_target_lm_head_with_a_bias_add_it(tmp_path):
    """Heads that share the target's LM head (original_lm_head, none stored) read it as the target does: Phi-2's
    lm_head has a bias, which moves the argmax of the tiny heads' logits."""
    from transformers import AutoModelForCausalLM

    target_dir = make_tiny_model_dir(tmp_path / "phi", "phi")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    path, reference = _variant("target_lm_head", tmp_path / "heads")
    reference["shared_lm_head"] = target.lm_head.weight
    reference["shared_lm_head_bias"] = target.lm_head.bias * 20  # (the tiny model's bias, made to matter)
    with torch.no_grad():
        target.lm_head.bias.mul_(20)
    state = {name: tensor.float() for name, tensor in target.state_dict().items()}
    target.float().save_pretrained(target_dir, state_dict=state)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with make_llm(target_dir, speculative_config=medusa_config(path)) as llm:
        calls = record_proposals(llm)
        run(llm, PROMPTS[:3], params)
        assert_heads_idle(llm)
    drafted = [(tokens, drafts) for tokens, drafts in calls if drafts]
    assert len(drafted) >= 6
    for tokens, drafts in drafted:
        assert drafts == reference_drafts(target.double(), k=len(drafts), token_ids=tokens, **reference)
    without_bias = {**reference, "shared_lm_head_bias": None}
    assert any(
        drafts != reference_drafts(target, k=len(drafts), token_ids=tokens, **without_bias)
        for tokens, drafts in drafted
    )


SCENARIOS = {
    "default": {},
    "chunked prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "preemption": {"num_blocks": 30},
    "no prefix caching": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("overrides", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_greedy_output_and_logprobs_equal_those_without_speculation(overrides, target_dir, heads):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    with make_llm(target_dir, **overrides) as base:
        expected = run(base, PROMPTS, params)
    with make_llm(target_dir, speculative_config=medusa_config(heads), **overrides) as spec:
        got = run(spec, PROMPTS, params)
        assert spec.engine.stats().speculation.num_draft_tokens > 0
        if "num_blocks" in overrides:
            assert spec.engine.stats().num_preemptions > 0
        assert_heads_idle(spec)
    assert_same(expected, got)


def test_prefix_cache_hits_and_n_siblings_give_the_same_tokens(target_dir, heads):
    """The later prompts' first 16 tokens come from the prefix cache, and n = 3 siblings share their prompt's
    blocks: the last prompt position is always computed, so the heads read its feature as for any prompt."""
    shared = list(range(60, 76))
    prompts = [shared + [3, 4, 5], shared + [9, 8, 7, 6], PROMPTS[1]]
    params = SamplingParams(n=3, max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    with make_llm(target_dir) as base:
        expected = [run(base, [p], params) for p in prompts]
    with make_llm(target_dir, speculative_config=medusa_config(heads)) as spec:
        got = [run(spec, [p], params) for p in prompts]
        assert spec.engine.stats().prefix_cache_hits > 0
        assert spec.engine.stats().speculation.num_draft_tokens > 0
        assert_heads_idle(spec)
    for want, have in zip(expected, got):
        assert_same(want, have)


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4}], ids=["", "chunked"])
def test_heads_guessing_a_successor_target_have_their_drafts_accepted(overrides, tmp_path):
    """The target's greedy next token is perm[last token]; head i guesses perm^(i + 2) of token n - 2, which is
    token n + i exactly when the heads read position n - 2 and head 0 guesses the token after the one just
    sampled: every draft is accepted (reading n - 1, or head i guessing i + 2 ahead, none would be)."""
    target_dir = make_tiny_model_dir(tmp_path / "target", "llama", num_hidden_layers=1)
    state, perm = successor_target_state(load_file(str(target_dir / "model.safetensors")))
    save_file(state, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    path = make_medusa_heads(
        tmp_path / "heads", successor_heads(state["model.embed_tokens.weight"], perm, 4), num_heads=4
    )
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with make_llm(target_dir, **overrides) as base:
        expected = run(base, PROMPTS, params)
    for tokens in (want[0][0] for want in expected):  # (the target is the successor it was made to be)
        assert all(b == int(perm[a]) for a, b in zip(tokens, tokens[1:]))
    with make_llm(target_dir, speculative_config=medusa_config(path, k=4), **overrides) as spec:
        got = run(spec, PROMPTS, params)
        stats = spec.engine.stats().speculation
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
        assert_heads_idle(spec)
    assert_same(expected, got)


def test_aborts_and_a_request_that_opted_out(target_dir, heads):
    """Aborted requests leave the others exact and nothing behind; a `speculative: false` request never drafts
    and the proposer keeps none of its features."""
    with make_llm(target_dir) as base:
        expected = run(base, PROMPTS, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    with make_llm(target_dir, speculative_config=medusa_config(heads)) as spec:
        check_aborts_and_an_opted_out_request(spec, expected, spec.engine.scheduler.proposer._features)
        assert_heads_idle(spec)


def test_bfloat16_runs(target_dir, heads):
    """In bfloat16 (the cpu backend's fused decode step, whose final hidden states the heads read)."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with make_llm(target_dir, dtype="bfloat16", speculative_config=medusa_config(heads)) as spec:
        results = spec.generate([PROMPTS[0]], params, use_tqdm=False)
        assert len(results[0].outputs[0].token_ids) == 12
        assert spec.engine.stats().speculation.num_draft_tokens > 0
        assert_heads_idle(spec)


def test_refusals_name_what_is_wrong(target_dir, tmp_path):
    def refused(config, match):
        with pytest.raises((SettingsConflictError, ValueError), match=match):
            make_llm(target_dir, speculative_config=config)

    def heads_with(name, tensors=None, **config_keys):
        return make_medusa_heads(tmp_path / name, tensors, num_heads=3, **config_keys)

    refused({"method": "medusa", "num_speculative_tokens": 2}, 'needs "model"')
    refused(medusa_config(heads_with("few"), k=4), "num_speculative_tokens 4 is more than the 3 medusa heads")
    tensors = random_medusa_tensors(3)
    del tensors["lm_heads.2.weight"]
    refused(medusa_config(heads_with("lacks", tensors)), r"lacks lm_heads\.2\.weight")
    tensors = random_medusa_tensors(3)
    del tensors["blocks.1.layers.0.bias"]
    refused(medusa_config(heads_with("bias", tensors)), r"lacks blocks\.1\.layers\.0\.bias")
    tensors = random_medusa_tensors(3)
    tensors["blocks.0.layers.0.weight"] = torch.zeros(64, 32)
    refused(medusa_config(heads_with("narrow", tensors)), r"blocks\.0\.layers\.0\.weight is \[64, 32\]")
    refused(medusa_config(heads_with("wide", hidden_size=96)), "96 wide")
    refused(medusa_config(heads_with("unbiased", medusa_fc_bias=False)), "medusa_fc_bias false")
    tensors = random_medusa_tensors(4)
    refused(medusa_config(heads_with("extra", tensors)), r"not used: blocks\.3\.layers\.0\.bias")
    refused(medusa_config(heads_with("truncated", truncated_vocab_size=100)), "needs a stored token_map")
    tensors = {**random_medusa_tensors(3), "token_map": torch.arange(600, 700)}
    refused(medusa_config(heads_with("far", tensors, truncated_vocab_size=100)), "outside the target's vocabulary")
    broken = heads_with("broken")
    (broken / "config.json").write_text("{not json")
    refused(medusa_config(broken), "medusa heads .* cannot be read: cannot read its config.json")
    refused(medusa_config(heads_with("file") / "model.safetensors"), "Medusa heads are a directory")


def test_the_authors_config_keys_are_read_as_vllm_reads_them(tmp_path):
    heads = make_medusa_heads(tmp_path / "h", num_heads=2, num_layers=3, authors=True)
    config = json.loads((heads / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (2, 3)
    from engine.spec_decode.medusa_loading import _read_config

    read = _read_config(heads)
    assert (read["num_heads"], read["num_hidden_layers"]) == (2, 3)
