"""On a CUDA device (skipped without one): the engine runs there and agrees with the CPU."""

import pytest
import torch

from engine import SamplingParams
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import make_llm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_tiny_model_greedy_on_cuda_matches_cpu(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path, "llama")
    prompts = [[5, 6, 7], list(range(10, 50)), [300] * 17]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    cpu = make_llm(model_dir).generate(prompts, params, use_tqdm=False)
    cuda = make_llm(model_dir, device="cuda").generate(prompts, params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in cuda] == [r.outputs[0].token_ids for r in cpu]
