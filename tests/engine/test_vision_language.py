"""Vision-language models (LLaVA on the tiny language models) against HF transformers on the same random
checkpoint, float32 greedy: tokens identical, logprobs within 1e-4, with one image or several, prompts chunked
inside an image, images keyed into the prefix cache, a preempted request resumed with its images; the offline API's
image forms and refusals."""

from __future__ import annotations

import pickle

import pytest
import torch

from engine.errors import InvalidParameterError
from engine.multimodal.images import read_local_image
from engine.sampling.params import SamplingParams
from scheduler import NewRequestData
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import assert_idle, make_llm
from tests.engine.vision_factories import chat_text, data_url, hf_greedy, make_tiny_llava_dir, random_image

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava_dir(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def llm(llava_dir):
    return make_llm(llava_dir)


def sampled_logprobs(result) -> list[float]:
    output = result.outputs[0]
    return [entry.logprob for entry in output.logprobs]


def assert_matches_hf(model_dir, result, text, images):
    tokens, logprobs = hf_greedy(model_dir, text, images, MAX_TOKENS)
    assert result.outputs[0].token_ids == tokens
    torch.testing.assert_close(torch.tensor(sampled_logprobs(result)), torch.tensor(logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "text_arch, select_strategy, feature_layer",
    [("llama", "default", -2), ("qwen2", "full", -1), ("mistral", "default", -1)],
)
def test_one_image_matches_hf(tmp_path, text_arch, select_strategy, feature_layer):
    model_dir = make_tiny_llava_dir(
        tmp_path / text_arch, text_arch, select_strategy=select_strategy, feature_layer=feature_layer
    )
    llm = make_llm(model_dir)
    image = random_image(0)
    text = chat_text([image, "What is in the picture?"])
    [result] = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    placeholders = 26 if select_strategy == "full" else 25
    assert result.prompt_token_ids.count(512) == placeholders
    assert_matches_hf(model_dir, result, text, [image])
    assert_idle(llm)


def test_two_images_across_prompt_chunks(llava_dir):
    """Chunks of 16 tokens end inside each image: an image is encoded once and its embeddings taken in parts."""
    llm = make_llm(llava_dir, max_num_batched_tokens=16)
    first, second = random_image(1, 64, 48), random_image(2, 30, 60)
    text = chat_text(["Compare", first, "with", second, "please."])
    [result] = llm.generate({"prompt": text, "multi_modal_data": {"image": [first, second]}}, GREEDY, use_tqdm=False)
    assert_matches_hf(llava_dir, result, text, [first, second])
    assert_idle(llm)


def test_the_prefix_cache_keys_blocks_by_their_images(llm, llava_dir):
    text = chat_text([random_image(3), "Describe it."])
    first, other = random_image(3), random_image(4)
    [a] = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)
    [b] = llm.generate({"prompt": text, "multi_modal_data": {"image": other}}, GREEDY, use_tqdm=False)
    [again] = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)
    image_start = a.prompt_token_ids.index(512)
    assert b.num_cached_tokens <= image_start  # no block holding one of the image's placeholders is shared
    assert again.num_cached_tokens >= len(text) // 2 and again.num_cached_tokens > image_start + 25
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    assert_matches_hf(llava_dir, b, text, [other])
    assert_matches_hf(llava_dir, again, text, [first])


def test_a_preempted_request_resumes_with_its_images(llava_dir):
    """A pool too small for the batch: requests are preempted mid-output and recomputed, images and all."""
    llm = make_llm(llava_dir, num_blocks=28, max_num_batched_tokens=32)
    images = [random_image(20 + i) for i in range(4)]
    texts = [chat_text([image, f"Picture {i}?"]) for i, image in enumerate(images)]
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in zip(texts, images)]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    for result, text, image in zip(results, texts, images):
        assert_matches_hf(llava_dir, result, text, [image])
    assert_idle(llm)


def test_chat_takes_data_urls_and_pil_images(llm, llava_dir, tmp_path):
    image = random_image(7)
    question = {"type": "text", "text": "What is this?"}
    forms = [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "image_url", "image_url": data_url(image)},  # (vLLM takes the URL alone too)
        {"type": "image_pil", "image_pil": image},
    ]
    results = [llm.chat([{"role": "user", "content": [form, question]}], GREEDY, use_tqdm=False)[0] for form in forms]
    assert_matches_hf(llava_dir, results[0], chat_text([image, "What is this?"]), [image])
    assert all(r.outputs[0].token_ids == results[0].outputs[0].token_ids for r in results)
    image.save(tmp_path / "picture.png")
    file_part = {"type": "image_url", "image_url": {"url": f"file://{tmp_path / 'picture.png'}"}}
    with pytest.raises(InvalidParameterError, match="allowed-local-media-path"):
        llm.chat([{"role": "user", "content": [file_part, question]}], GREEDY, use_tqdm=False)
    allowed = make_llm(llava_dir, allowed_local_media_path=str(tmp_path))
    [from_file] = allowed.chat([{"role": "user", "content": [file_part, question]}], GREEDY, use_tqdm=False)
    assert from_file.outputs[0].token_ids == results[0].outputs[0].token_ids
    outside = {"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}
    with pytest.raises(InvalidParameterError, match="outside"):
        allowed.chat([{"role": "user", "content": [outside, question]}], GREEDY, use_tqdm=False)


def test_file_urls_outside_the_folder_or_unreadable_are_invalid_parameters(tmp_path):
    """Every file:// URL that reads no file under the folder is an InvalidParameterError (the server's 400 naming the
    part), never another error (a 500): a symlink or `..` out of it, a NUL byte, a name too long, a symlink loop."""
    folder = tmp_path / "media"
    folder.mkdir()
    (tmp_path / "secret.png").write_bytes(b"outside")
    (folder / "picture.png").write_bytes(b"inside")
    (folder / "out.png").symlink_to(tmp_path / "secret.png")
    (folder / "loop1").symlink_to(folder / "loop2")
    (folder / "loop2").symlink_to(folder / "loop1")
    assert read_local_image(f"file://{folder}/picture.png", folder, "url") == b"inside"
    cases = {
        "out.png": "outside",
        "..%2Fsecret.png": "outside",
        "../media/../secret.png": "outside",
        "picture%00.png": "cannot be read",
        "a" * 300: "cannot be read",
        "loop1": "cannot be read|names no file",
        "": "names no file",
    }
    for name, message in cases.items():
        with pytest.raises(InvalidParameterError, match=message):
            read_local_image(f"file://{folder}/{name}", folder, "url")


def test_images_and_placeholders_must_pair_up(llm):
    image = random_image(8)
    with pytest.raises(InvalidParameterError, match="placeholder"):
        llm.generate({"prompt": chat_text([image, image, "two?"]), "multi_modal_data": {"image": image}}, GREEDY)
    with pytest.raises(InvalidParameterError, match="placeholder"):
        llm.generate({"prompt": chat_text(["none here"]), "multi_modal_data": {"image": image}}, GREEDY)
    with pytest.raises(InvalidParameterError, match="PIL"):
        llm.generate({"prompt": chat_text([image]), "multi_modal_data": {"image": b"png bytes"}}, GREEDY)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": image}}, GREEDY)
    assert_idle(llm)


def test_limit_mm_per_prompt(llava_dir):
    llm = make_llm(llava_dir, limit_mm_per_prompt={"image": 1})
    image = random_image(9)
    with pytest.raises(InvalidParameterError, match="at most 1"):
        llm.generate({"prompt": chat_text([image, image]), "multi_modal_data": {"image": [image, image]}}, GREEDY)
    text_only = make_llm(llava_dir, limit_mm_per_prompt={"image": 0})
    assert text_only.engine.processor is None and text_only.engine.runner.vision is None
    text = chat_text(["Just text."])
    [result] = text_only.generate(text, GREEDY, use_tqdm=False)
    assert_matches_hf(llava_dir, result, text, [])
    with pytest.raises(ValueError, match="multi_modal_data"):
        text_only.generate({"prompt": chat_text([image]), "multi_modal_data": {"image": image}}, GREEDY)
    with pytest.raises(ValueError, match="takes no images"):
        text_only.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image}]}], GREEDY)


def test_a_text_model_refuses_images(tmp_path):
    llm = make_llm(make_tiny_model_dir(tmp_path / "text"))
    image = random_image(10)
    with pytest.raises(ValueError, match="takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}]}])
    with pytest.raises(ValueError, match="vision-language"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": image}})


def test_the_step_message_carries_the_images(llm):
    """What a worker process receives pickles with the images' tensors and positions."""
    image = random_image(11)
    _, multi_modal = llm.engine.processor.process(chat_text([image]), [image])
    data = NewRequestData("r", [1, 2, 3], 3, ((0,),), 0, multi_modal=multi_modal)
    copy = pickle.loads(pickle.dumps(data))
    [original], [restored] = data.multi_modal.images, copy.multi_modal.images
    assert restored.positions == original.positions and restored.key == original.key
    torch.testing.assert_close(restored.data["pixel_values"], original.data["pixel_values"])
