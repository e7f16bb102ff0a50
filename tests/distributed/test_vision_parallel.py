"""A vision-language model (the tiny LLaVA) on two tensor-parallel ranks over gloo on CPU: each rank builds its
shard of the language model and the whole vision encoder, and encodes the images the step message brings it.
Greedy tokens identical to one process and logprobs within 1e-5 in float32, with images across prompt chunks and
preemptions."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.references import assert_idle
from tests.engine.vision_factories import chat_text, make_tiny_llava_dir, random_image

pytestmark = pytest.mark.timeout(300)

TINY = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava_dir(tmp_path_factory.mktemp("llava-tp"))


def generate(model_dir, prompts, tp: int, **overrides):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(str(model_dir), **{**TINY, **overrides}, tensor_parallel_size=tp) as llm:
        if tp > 1:  # every rank holds the vision encoder (a worker without one would refuse the images' requests)
            assert llm.engine.runner.vision is not None
        results = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        assert_idle(llm)
    return [(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in results], stats


def test_two_ranks_give_one_processs_outputs_with_images(llava_dir):
    first, second, third = random_image(40), random_image(41, 64, 48), random_image(42, 30, 60)
    prompts = [
        {"prompt": chat_text([first, "What is in the picture?"]), "multi_modal_data": {"image": first}},
        {"prompt": chat_text(["Compare", first, "with", second]), "multi_modal_data": {"image": [first, second]}},
        {"prompt": chat_text([third, "And this one?"]), "multi_modal_data": {"image": third}},
        {"prompt": chat_text(["No picture here."])},
        {"prompt": chat_text([second, "Colours?"]), "multi_modal_data": {"image": second}},
        {"prompt": chat_text([first, "Again?"]), "multi_modal_data": {"image": first}},
    ]
    expected, _ = generate(llava_dir, prompts, 1, num_blocks=24)  # (a pool too small for the batch)
    got, stats = generate(llava_dir, prompts, 2, num_blocks=24)
    assert stats.num_preemptions > 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)
