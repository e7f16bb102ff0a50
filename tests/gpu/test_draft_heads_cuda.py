"""On a CUDA device (skipped without one): EAGLE, EAGLE-3 and MTP draft heads, with the target's decode steps
replayed from CUDA graphs (EAGLE-3's tapped layers copied into each graph's static buffers) and eager: the
proposals of the graphs' run are the eager run's, and the tokens those of the same engine without speculation
(float32, the triton backend)."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.engine.eagle_factories import make_eagle_head, record_proposals
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import make_llm
from tests.engine.test_mtp import add_prediction_layer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [list(range(20, 30)) * 3, [5, 6, 7, 8, 9] * 4 + [40, 41], list(range(100, 131)), [7] * 6]


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_draft_heads_on_cuda_with_and_without_graphs(method, tmp_path):
    if method == "mtp":
        whole = make_tiny_model_dir(tmp_path / "whole", "glm4_moe", num_hidden_layers=3)
        target, config = add_prediction_layer(whole, tmp_path / "target"), {"method": "mtp"}
    else:
        target = make_tiny_model_dir(tmp_path / "target", "llama", num_hidden_layers=4)
        head = make_eagle_head(tmp_path / "head", method, feature_layers=[0, 1, 2], draft_vocab=200)
        config = {"method": method, "model": str(head)}
    config.update(num_speculative_tokens=3, adaptive=False, step_cost_model=False)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    settings = dict(device="cuda", attention_backend="triton", max_num_seqs=8)
    with make_llm(target, enforce_eager=True, **settings) as base:
        expected = [r.outputs[0].token_ids for r in base.generate(PROMPTS, params, use_tqdm=False)]
    proposals = {}
    for eager in (True, False):
        with make_llm(target, enforce_eager=eager, speculative_config=config, **settings) as llm:
            assert (llm.engine.runner.cuda_graphs == "off") == eager
            calls = record_proposals(llm)
            got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params, use_tqdm=False)]
            assert got == expected
            assert llm.engine.stats().speculation.num_draft_tokens > 0
            assert llm.engine.scheduler.kv_cache_manager.usage == 0
            proposals[eager] = calls
    assert proposals[False] == proposals[True]
