"""The vision-language families beyond LLaVA (Mistral 3, LLaVA-NeXT, LLaVA-OneVision, InternVL, Idefics3, SmolVLM,
Aya Vision) against HF transformers on the same tiny random checkpoint, float32 greedy: tokens identical, logprobs within 1e-4,
with one image, two images of different sizes, and a prompt chunked inside its images; each image's placeholder
positions as HF's model fills them, and its prefix-cache key its own whichever images share its prompt. A family
whose processor needs a package not installed here (torchvision, num2words) is skipped, naming it."""

from __future__ import annotations

import pytest
import torch

from engine.loading.loader import stored_weight_names
from engine.sampling.params import SamplingParams
from tests.engine.references import assert_idle, make_llm
from tests.engine.vision_factories import random_image
from tests.engine.vision_family_factories import (
    FAMILY_CASES,
    VisionFamilyCase,
    hf_greedy,
    make_tiny_idefics3_dir,
    prompt_text,
)

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """name -> (the family's case, its tiny checkpoint, an LLM serving it), each built once."""
    built: dict[str, tuple[VisionFamilyCase, object, object]] = {}

    def serve(name: str):
        case = FAMILY_CASES[name]
        missing = case.missing()
        if missing:
            pytest.skip(f"{case.name}'s processor needs {', '.join(missing)}, not installed")
        if name not in built:
            model_dir = case.build(tmp_path_factory.mktemp(case.name))
            built[name] = case, model_dir, make_llm(model_dir)
        return built[name]

    return serve


@pytest.fixture(scope="module", params=sorted(FAMILY_CASES))
def family(request, served):
    return served(request.param)


def assert_matches_hf(model_dir, result, text, images):
    tokens, logprobs = hf_greedy(model_dir, text, images, MAX_TOKENS)
    assert result.outputs[0].token_ids == tokens
    sampled = [entry.logprob for entry in result.outputs[0].logprobs]
    torch.testing.assert_close(torch.tensor(sampled), torch.tensor(logprobs), atol=1e-4, rtol=0)


def hf_image_positions(model_dir, text, images) -> list[int]:
    """Where HF's model puts the images' embeddings: the positions of its processor's ids that hold the image
    token."""
    from transformers import AutoConfig, AutoProcessor

    token_id = AutoConfig.from_pretrained(model_dir).image_token_id
    out = AutoProcessor.from_pretrained(model_dir)(text=[text], images=images, return_tensors="pt")
    return [i for i, token in enumerate(out["input_ids"][0].tolist()) if token == token_id]


def test_one_image_matches_hf(family):
    case, model_dir, llm = family
    image = random_image(0)
    text = prompt_text([image, "What is in the picture?"], case.placeholder)
    [result] = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    _, multi_modal = llm.engine.processor.process(text, [image])
    assert list(multi_modal.images[0].positions) == hf_image_positions(model_dir, text, [image])
    assert_matches_hf(model_dir, result, text, [image])
    assert_idle(llm)


def test_two_images_of_different_sizes(family):
    case, model_dir, llm = family
    first, second = random_image(1, 64, 48), random_image(2, 30, 60)
    text = prompt_text(["Compare", first, "with", second, "please."], case.placeholder)
    prompt = {"prompt": text, "multi_modal_data": {"image": [first, second]}}
    [result] = llm.generate(prompt, GREEDY, use_tqdm=False)
    _, multi_modal = llm.engine.processor.process(text, [first, second])
    a, b = multi_modal.images
    assert a.end <= b.start and a.num_embeds != b.num_embeds  # (the sizes differ: so do their token counts)
    assert list(a.positions + b.positions) == hf_image_positions(model_dir, text, [first, second])
    assert_matches_hf(model_dir, result, text, [first, second])
    assert_idle(llm)


def test_a_prompt_chunked_inside_its_images(family):
    """Chunks of 8 tokens end inside each image: an image is encoded once and its embeddings taken in parts."""
    case, model_dir, _ = family
    llm = make_llm(model_dir, max_num_batched_tokens=8, max_num_seqs=8)
    first, second = random_image(3, 40, 40), random_image(4, 56, 24)
    text = prompt_text(["Two:", first, second, "which?"], case.placeholder)
    [result] = llm.generate({"prompt": text, "multi_modal_data": {"image": [first, second]}}, GREEDY, use_tqdm=False)
    assert_matches_hf(model_dir, result, text, [first, second])
    assert_idle(llm)


def test_an_image_key_is_its_own(family):
    """An image's tensors (its prefix-cache key) are the same alone and beside a larger image that pads the
    prompt's."""
    case, _, llm = family
    small, large = random_image(5, 20, 20), random_image(6, 64, 48)
    _, alone = llm.engine.processor.process(prompt_text([small], case.placeholder), [small])
    _, paired = llm.engine.processor.process(prompt_text([small, large], case.placeholder), [small, large])
    assert alone.images[0].key == paired.images[0].key
    assert alone.images[0].key != paired.images[1].key


def test_mistral3_fills_only_the_img_positions(served):
    """Pixtral's placeholders: each row of [IMG] tokens ends in [IMG_BREAK], the image in [IMG_END]; the embeddings
    fill the [IMG] positions alone, row by row, so an image's positions are not one run."""
    case, _, llm = served("mistral3")
    image = random_image(7, 64, 48)  # resized to 32 x 24: 3 rows of 4 tokens (8-pixel merged patches)
    token_ids, multi_modal = llm.engine.processor.process(prompt_text(["see", image], case.placeholder), [image])
    [image_input] = multi_modal.images
    tokenizer = llm.engine.processor.hf.tokenizer
    img, img_break, img_end = tokenizer.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    span = token_ids[image_input.start : image_input.end + 1]
    assert span == ([img] * 4 + [img_break]) * 2 + [img] * 4 + [img_end]
    assert image_input.num_embeds == 12 and len(image_input.positions) < image_input.end - image_input.start
    assert all(token_ids[p] == img for p in image_input.positions)


@pytest.mark.parametrize("whole_ties, text_ties", [(True, False), (False, True)])
def test_the_lm_head_is_tied_as_transformers_ties_it(tmp_path, whole_ties, text_ties):
    """transformers 5 ties a vision-language model's LM head by the whole config's flag (saving no head), and loads
    a head the checkpoint stores: the language model's own flag decides nothing by itself (a family's config may
    fold it into the whole config's, as LLaVA-OneVision's does)."""
    model_dir = make_tiny_idefics3_dir(tmp_path / "idefics3", tie_word_embeddings=whole_ties, text_ties=text_ties)
    assert ("lm_head.weight" in stored_weight_names(model_dir)) is not whole_ties
    llm = make_llm(model_dir)
    image = random_image(8)
    text = prompt_text([image, "Tied?"], "<image>")
    [result] = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    assert_matches_hf(model_dir, result, text, [image])
