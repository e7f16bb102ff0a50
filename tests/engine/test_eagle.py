"""EAGLE and EAGLE-3 speculation end to end, on tiny targets and heads made here (tests/engine/eagle_factories.py).

- Every proposal's drafts equal a float64 reference's: the head's recipe written out from the papers and vLLM's
  layout, reading the HF target's hidden states (its final ones, or the streams entering three layers).
- Greedy tokens and logprobs with the head's drafts equal those without, under chunked prefill, preemption,
  prefix-cache hits (the head's context then starts where the target's features do) and aborts; afterwards the
  target's KV blocks and the head's are all free and it holds no request.
- A head that computes what a one-layer target computes has most of its drafts accepted (the features, the
  positions and the head's cache line up).
- Refusals name what is wrong: no model, another hidden width, missing or unused tensors, feature layers out of
  range (two tensor-parallel ranks: tests/distributed/test_tensor_parallel.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from engine.errors import SettingsConflictError
from tests.engine.eagle_factories import (
    make_eagle_head,
    mimic_head_tensors,
    random_head_tensors,
    record_proposals,
    reference_drafts,
)
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import assert_idle, make_llm
from tests.engine.test_spec_decode import PROMPTS, assert_same, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FEATURE_LAYERS = [1, 2, 0]
"""EAGLE-3's target layers in the tests (a 4-layer target; not in order: the head reads them in the target's layer
order, as vLLM's and SGLang's layer loops collect them, whatever order the config lists them in)."""


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("eagle") / "target", "llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    return {
        "eagle": make_eagle_head(root / "eagle", "eagle", seed=1),
        "eagle3": make_eagle_head(root / "eagle3", "eagle3", seed=2, feature_layers=FEATURE_LAYERS, draft_vocab=200),
    }


def eagle_config(method: str, head: Path, k: int = 3) -> dict:
    # every decoding request drafts k each step (no adaptive k, no step-cost model), so every path is taken
    return {
        "method": method,
        "model": str(head),
        "num_speculative_tokens": k,
        "adaptive": False,
        "step_cost_model": False,
    }


def assert_head_idle(llm) -> None:
    assert_idle(llm)
    proposer = llm.engine.scheduler.proposer
    assert proposer.num_requests == 0
    assert proposer.cache.num_free_blocks == proposer.cache.num_blocks


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_each_proposal_is_the_reference_heads(method, target_dir, heads):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    tensors = load_file(str(heads[method] / "model.safetensors"))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with make_llm(target_dir, speculative_config=eagle_config(method, heads[method])) as llm:
        model = llm.engine.runner.model
        assert model.feature_layers == (tuple(sorted(FEATURE_LAYERS)) if method == "eagle3" else ())
        assert llm.engine.runner.draft_features == ("tapped" if method == "eagle3" else "final")
        calls = record_proposals(llm)
        run(llm, PROMPTS[:3], params)
        assert_head_idle(llm)
    drafted = [(tokens, drafts) for tokens, drafts in calls if drafts]
    assert len(drafted) >= 6 and any(len(d) == 3 for _, d in drafted)
    for tokens, drafts in drafted:
        assert drafts == reference_drafts(target, tensors, method, tokens, len(drafts), sorted(FEATURE_LAYERS))


SCENARIOS = {
    "default": {},
    # prompts longer than a step's budget: the head reads them over several steps
    "chunked prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "preemption": {"num_blocks": 30},
    "no prefix caching": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("overrides", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_greedy_output_and_logprobs_equal_those_without_speculation(method, overrides, target_dir, heads):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    with make_llm(target_dir, **overrides) as base:
        expected = run(base, PROMPTS, params)
    with make_llm(target_dir, speculative_config=eagle_config(method, heads[method]), **overrides) as spec:
        got = run(spec, PROMPTS, params)
        assert spec.engine.stats().speculation.num_draft_tokens > 0
        if "num_blocks" in overrides:
            assert spec.engine.stats().num_preemptions > 0
        assert_head_idle(spec)
    assert_same(expected, got)


def test_a_prefix_cache_hit_takes_the_heads_blocks_of_that_prefix_or_starts_after_it(target_dir, heads):
    """The later requests' first 16 tokens come from the prefix cache, where the target computes no feature.
    The third request's prefix (and the token after it) is the first's, whose head blocks are indexed: it takes
    them and reads on from position 16 with the whole context. The second's token 16 differs (the head read the
    first's at position 15), so its head reads from position 16 on (its positions still the absolute ones).
    Their tokens stay the target's."""
    shared = list(range(60, 76))
    prompts = [shared + [3, 4, 5], shared + [9, 8, 7, 6], shared + [3, 4, 5, 1]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with make_llm(target_dir) as base:
        expected = [run(base, [p], params) for p in prompts]
    with make_llm(target_dir, speculative_config=eagle_config("eagle3", heads["eagle3"])) as spec:
        proposer = spec.engine.scheduler.proposer
        noted = []
        release = proposer.release

        def release_and_note(request_id):
            sequence = proposer._sequences.get(request_id)
            if sequence is not None:
                noted.append((sequence.offset, sequence.num_indexed))
            release(request_id)

        proposer.release = release_and_note
        got = [run(spec, [p], params) for p in prompts]
        assert spec.engine.stats().prefix_cache_hits > 0
        assert [offset for offset, _ in noted] == [0, 16, 0]
        assert noted[2][1] >= 4  # the first's four blocks taken, and indexed on
        assert_head_idle(spec)
    for want, have in zip(expected, got):
        assert_same(want, have)


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4}], ids=["", "chunked"])
def test_a_head_mimicking_a_one_layer_target_has_most_drafts_accepted(overrides, tmp_path):
    """Also when prompts are computed in chunks of 16: the head reads each chunk's positions in the step that
    computed them (observe), so its context is the whole prompt (it was the last 16 positions: 48% accepted)."""
    target_dir = make_tiny_model_dir(tmp_path / "target", "llama", num_hidden_layers=1)
    state = load_file(str(target_dir / "model.safetensors"))
    embed = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()  # RMS 1 per row
    for name in state:
        if "norm" in name:
            state[name] = torch.ones_like(state[name])
    save_file(state, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    head = make_eagle_head(tmp_path / "head", "eagle", tensors=mimic_head_tensors(state))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with make_llm(target_dir, **overrides) as base:
        expected = run(base, PROMPTS, params)
    with make_llm(target_dir, speculative_config=eagle_config("eagle", head, k=4), **overrides) as spec:
        got = run(spec, PROMPTS, params)
        stats = spec.engine.stats().speculation
        assert stats.num_accepted_tokens >= 0.7 * stats.num_draft_tokens > 0  # (measured: 130 of 160 both ways)
        assert_head_idle(spec)
    assert_same(expected, got)
    # n = 3 siblings: after the first, each prompt is a prefix-cache hit, whose head blocks the first's indexed
    # (measured: 390 of 480 accepted; 248 of 1022 when each sibling's head context started after the hit)
    siblings = SamplingParams(n=3, max_tokens=30, temperature=0, ignore_eos=True)
    with make_llm(target_dir, speculative_config=eagle_config("eagle", head, k=4), **overrides) as spec:
        run(spec, PROMPTS, siblings)
        stats = spec.engine.stats().speculation
        assert stats.num_accepted_tokens >= 0.7 * stats.num_draft_tokens > 0
        assert_head_idle(spec)


def test_aborts_mid_run_leave_the_others_exact_and_free_the_heads_cache(target_dir, heads):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with make_llm(target_dir) as base:
        expected = run(base, PROMPTS, params)
    with make_llm(target_dir, speculative_config=eagle_config("eagle3", heads["eagle3"])) as spec:
        engine = spec.engine
        tokens: dict[str, list[int]] = {}
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
            tokens[f"r{i}"] = []
        for step in range(6):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            if step == 3:
                engine.abort(["r1", "r4"])
                assert "r1" not in engine.scheduler.proposer._sequences
        while engine.has_work:
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        assert_head_idle(spec)
    for i, want in enumerate(expected):
        got = tokens[f"r{i}"]
        assert got == (want[0][0][: len(got)] if i in (1, 4) else want[0][0])


def test_bfloat16_runs(target_dir, heads):
    """In bfloat16 (the cpu backend's fused decode step where EAGLE's final hidden states are read; EAGLE-3 taps
    layers inside the loop, so its steps run unfused)."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for method in ("eagle", "eagle3"):
        with make_llm(target_dir, dtype="bfloat16", speculative_config=eagle_config(method, heads[method])) as spec:
            results = spec.generate([PROMPTS[0]], params, use_tqdm=False)
            assert len(results[0].outputs[0].token_ids) == 12
            assert spec.engine.stats().speculation.num_draft_tokens > 0
            assert_head_idle(spec)


def test_refusals_name_what_is_wrong(target_dir, heads, tmp_path):
    def refused(config, match, **overrides):
        with pytest.raises((SettingsConflictError, ValueError), match=match):
            make_llm(target_dir, speculative_config=config, **overrides)

    refused({"method": "eagle", "num_speculative_tokens": 2}, 'needs "model"')
    refused({"method": "ngram", "model": str(heads["eagle"]), "num_speculative_tokens": 2}, "eagle3")
    wide = make_eagle_head(tmp_path / "wide", "eagle3", feature_layers=FEATURE_LAYERS)
    config = (
        (wide / "config.json").read_text().replace('"hidden_size": 64', '"hidden_size": 64, "target_hidden_size": 96')
    )
    (wide / "config.json").write_text(config)
    refused(eagle_config("eagle3", wide), "width 96")
    tensors = random_head_tensors("eagle3", 0, None, 512)
    del tensors["midlayer.hidden_norm.weight"]
    refused(eagle_config("eagle3", make_eagle_head(tmp_path / "lacks", "eagle3", tensors=tensors)), "hidden_norm")
    refused(eagle_config("eagle3", make_eagle_head(tmp_path / "far", "eagle3", feature_layers=[0, 1, 9])), "layers")
    tensors = random_head_tensors("eagle", 0, None, 512)
    tensors["layers.0.extra.weight"] = torch.zeros(2)
    refused(eagle_config("eagle", make_eagle_head(tmp_path / "extra", "eagle", tensors=tensors)), "not used")


def test_a_request_that_opted_out_keeps_no_features_in_the_head(target_dir, heads):
    """A `speculative: false` request never drafts: the head keeps none of its target features (they would pile
    up to max_num_batched_tokens rows a request, copied every step); the others still draft."""
    spec_params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, speculative=False)
    with make_llm(target_dir) as base:
        expected = run(base, PROMPTS[:2], spec_params) + run(base, PROMPTS[2:3], plain)
    with make_llm(target_dir, speculative_config=eagle_config("eagle", heads["eagle"])) as spec:
        engine = spec.engine
        proposer = engine.scheduler.proposer
        engine.add_request("s0", PROMPTS[0], spec_params)
        engine.add_request("s1", PROMPTS[1], spec_params)
        engine.add_request("plain", PROMPTS[2], plain)
        tokens: dict[str, list[int]] = {"s0": [], "s1": [], "plain": []}
        while engine.has_work:
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            assert "plain" not in proposer._sequences
        assert engine.stats().speculation.num_draft_tokens > 0
        assert_head_idle(spec)
    assert [tokens["s0"], tokens["s1"], tokens["plain"]] == [want[0][0] for want in expected]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_head_on_a_scaled_embedding_target_reads_the_embedding_rows_as_stored(method, tmp_path, heads):
    """Gemma's model scales its embeddings by sqrt(hidden) inside its forward; the head reads the embedding's rows
    (vLLM's head shares the embedding module, without the target's normalizer; the heads are trained so). On the
    generic decoder, whose layer loop taps EAGLE-3's layers too."""
    from transformers import AutoModelForCausalLM

    target_dir = make_tiny_model_dir(tmp_path / "gemma", "gemma", num_hidden_layers=4)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    tensors = load_file(str(heads[method] / "model.safetensors"))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with make_llm(target_dir, speculative_config=eagle_config(method, heads[method])) as llm:
        calls = record_proposals(llm)
        run(llm, PROMPTS[:2], params)
        assert_head_idle(llm)
    drafted = [(tokens, drafts) for tokens, drafts in calls if drafts]
    assert drafted
    for tokens, drafts in drafted:
        assert drafts == reference_drafts(target, tensors, method, tokens, len(drafts), sorted(FEATURE_LAYERS))


def test_a_head_configured_for_a_shorter_context_drafts_past_it(target_dir, heads, tmp_path):
    """An EAGLE head's config may name a shorter max_position_embeddings than the target serves (2048 in
    yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): the head runs at the target's positions (its rotary tables reach
    max_model_len), so drafting goes on past it, as vLLM raises the draft's value to the target's context."""
    import json
    import shutil

    short = tmp_path / "short"
    shutil.copytree(heads["eagle"], short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 32
    (short / "config.json").write_text(json.dumps(config))
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    tensors = load_file(str(short / "model.safetensors"))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with make_llm(target_dir, speculative_config=eagle_config("eagle", short)) as llm:
        calls = record_proposals(llm)
        run(llm, PROMPTS[2:3], params)
        assert_head_idle(llm)
    late = [(tokens, drafts) for tokens, drafts in calls if drafts and len(tokens) > 40]
    assert late
    for tokens, drafts in late:
        assert drafts == reference_drafts(target, tensors, "eagle", tokens, len(drafts), [])


def test_eagle3_decode_steps_replay_decode_graphs_with_their_taps(target_dir, heads):
    """Decode graphs (EagerReplay: the padded step a CUDA graph runs) copy EAGLE-3's tapped layers into static
    buffers of their own, which the step's features are read from: every proposal still the reference's, the
    tokens those without speculation."""
    from transformers import AutoModelForCausalLM

    from engine.runner.cuda_graphs import EagerReplay, decode_buckets

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    tensors = load_file(str(heads["eagle3"] / "model.safetensors"))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with make_llm(target_dir) as base:
        expected = run(base, PROMPTS[:3], params)
    with make_llm(target_dir, speculative_config=eagle_config("eagle3", heads["eagle3"], k=1)) as llm:
        runner = llm.engine.runner
        runner.capture_decode_graphs(decode_buckets(runner.limits.max_num_seqs), EagerReplay)
        calls = record_proposals(llm)
        got = run(llm, PROMPTS[:3], params)
        assert sum(graph.replays for graph in runner.graphs._graphs.values()) > 0
        assert_head_idle(llm)
    assert_same(expected, got)
    drafted = [(tokens, drafts) for tokens, drafts in calls if drafts]
    assert len(drafted) >= 6
    for tokens, drafts in drafted:
        assert drafts == reference_drafts(target, tensors, "eagle3", tokens, len(drafts), sorted(FEATURE_LAYERS))
