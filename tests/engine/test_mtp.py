"""Multi-token prediction (`{"method": "mtp"}`) for GLM-4.5 and DeepSeek-V3, on tiny checkpoints made here: HF
builds the model with one layer more, whose decoder layer becomes the prediction layer, given the head tensors a
real checkpoint stores beside it (enorm, hnorm, eh_proj, shared_head, a copy of the embedding).

- Every proposal's drafts equal a reference (float32: HF's grouped experts take no float64): HF's own decoder
  layer (MoE, and DeepSeek's latent attention) over eh_proj([enorm(embed); hnorm(feature)]) on the HF target's
  final hidden states.
- Greedy tokens and logprobs with the layer's drafts equal those without, under chunked prefill and preemption;
  afterwards every KV block of the target and the layer is free.
- A family without a served prediction layer, or a checkpoint without one, is refused naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from engine.errors import SettingsConflictError
from tests.engine.eagle_factories import record_proposals
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import assert_idle, make_llm
from tests.engine.test_deepseek_equivalence import make_deepseek_dir
from tests.engine.test_spec_decode import PROMPTS, assert_same, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def add_prediction_layer(whole: Path, path: Path, seed: int = 3) -> Path:
    """`whole` (L + 1 layers) as a checkpoint of L layers whose layer L is its prediction layer."""
    shutil.copytree(whole, path)
    config = json.loads((path / "config.json").read_text())
    layers = config["num_hidden_layers"] - 1
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    state = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    p = f"model.layers.{layers}."
    state.update(
        {
            p + "enorm.weight": 1 + torch.randn(hidden, generator=g) * 0.2,
            p + "hnorm.weight": 1 + torch.randn(hidden, generator=g) * 0.2,
            p + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.15,
            p + "shared_head.norm.weight": 1 + torch.randn(hidden, generator=g) * 0.2,
            p + "shared_head.head.weight": torch.randn(vocab, hidden, generator=g) * 0.15,
            p + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
        }
    )
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=["glm4_moe", "deepseek_v3"])
def checkpoints(request, tmp_path_factory) -> tuple[Path, Path]:
    """(the whole L + 1-layer HF model, the L-layer checkpoint with its prediction layer)."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "glm4_moe":
        whole = make_tiny_model_dir(root / "whole", "glm4_moe", num_hidden_layers=3)
    else:
        whole = make_deepseek_dir(root / "whole", "deepseek_v3", num_hidden_layers=4)
    return whole, add_prediction_layer(whole, root / "mtp")


def mtp_config(k: int = 2) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "adaptive": False, "step_cost_model": False}


def reference_drafts(whole, target, state: dict, token_ids: list[int], k: int) -> list[int]:
    layers = target.config.num_hidden_layers
    p = f"model.layers.{layers}."
    eps = target.config.rms_norm_eps
    t = {name[len(p) :]: tensor.float() for name, tensor in state.items() if name.startswith(p)}

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    block = whole.model.layers[layers]
    with torch.no_grad():
        features = target(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0]
        inputs, feats, drafts = list(token_ids[1:]), [features[i] for i in range(len(token_ids) - 1)], []
        for _ in range(k):
            positions = torch.arange(len(inputs))
            embeds = target.model.embed_tokens(torch.tensor(inputs)).masked_fill((positions == 0)[:, None], 0.0)
            x = torch.cat([rms(embeds, t["enorm.weight"]), rms(torch.stack(feats), t["hnorm.weight"])], -1)
            x = (x @ t["eh_proj.weight"].T)[None]
            out = block(
                x,
                position_embeddings=whole.model.rotary_emb(x, positions[None]),
                attention_mask=None,
                position_ids=positions[None],
            )
            out = (out[0] if isinstance(out, tuple) else out)[0]
            logits = rms(out[-1], t["shared_head.norm.weight"]) @ t["shared_head.head.weight"].T
            drafts.append(int(logits.argmax()))
            inputs.append(drafts[-1])
            feats.append(out[-1])
    return drafts


def test_each_proposal_is_the_reference_layers(checkpoints):
    from transformers import AutoModelForCausalLM

    whole_dir, mtp_dir = checkpoints
    whole = AutoModelForCausalLM.from_pretrained(whole_dir, dtype=torch.float32, attn_implementation="sdpa")
    target = AutoModelForCausalLM.from_pretrained(mtp_dir, dtype=torch.float32, attn_implementation="sdpa")
    state = load_file(str(mtp_dir / "model.safetensors"))
    with make_llm(mtp_dir, speculative_config=mtp_config()) as llm:
        proposer = llm.engine.scheduler.proposer
        calls = record_proposals(llm)
        run(llm, PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert proposer.num_requests == 0 and proposer.cache.num_free_blocks == proposer.cache.num_blocks
    drafted = [(tokens, drafts) for tokens, drafts in calls if drafts]
    assert len(drafted) >= 6 and any(len(d) == 2 for _, d in drafted)
    for tokens, drafts in drafted:
        assert drafts == reference_drafts(whole, target, state, tokens, len(drafts))


SCENARIOS = {
    "default": {},
    "chunked prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "preemption": {"num_blocks": 40},
}


@pytest.mark.parametrize("overrides", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_greedy_output_and_logprobs_equal_those_without_speculation(checkpoints, overrides):
    _, mtp_dir = checkpoints
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    with make_llm(mtp_dir, **overrides) as base:
        expected = run(base, PROMPTS, params)
    with make_llm(mtp_dir, speculative_config=mtp_config(3), **overrides) as spec:
        got = run(spec, PROMPTS, params)
        assert spec.engine.stats().speculation.num_draft_tokens > 0
        if "num_blocks" in overrides:
            assert spec.engine.stats().num_preemptions > 0
        assert_idle(spec)
        proposer = spec.engine.scheduler.proposer
        assert proposer.num_requests == 0 and proposer.cache.num_free_blocks == proposer.cache.num_blocks
    assert_same(expected, got)


def test_refusals_name_what_is_missing(checkpoints, tiny_llama_dir, tmp_path):
    whole_dir, _ = checkpoints
    with pytest.raises(SettingsConflictError, match="has no multi-token-prediction layer served"):
        make_llm(tiny_llama_dir, speculative_config=mtp_config())
    none = shutil.copytree(whole_dir, tmp_path / "none")
    config = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(SettingsConflictError, match="num_nextn_predict_layers"):
        make_llm(none, speculative_config=mtp_config())
    bare = shutil.copytree(whole_dir, tmp_path / "bare")
    config = json.loads((bare / "config.json").read_text())
    config.update(num_hidden_layers=config["num_hidden_layers"] - 1, num_nextn_predict_layers=1)
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(SettingsConflictError, match="stores no prediction layer"):
        make_llm(bare, speculative_config=mtp_config())
