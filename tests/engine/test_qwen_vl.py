"""Qwen2-VL and Qwen2.5-VL (multimodal RoPE) against HF transformers on the same tiny random checkpoint, float32
greedy: tokens identical, logprobs within 1e-4, with one image, two of different grids, text alone, prompts chunked
inside images, prefix-cache hits past an image and none with another image, preempted requests resumed; the rotary
positions the processor places equal to HF's get_rope_index and the sectioned rotation equal to HF's, decoding through
the fused CPU decode step."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from engine.errors import InvalidParameterError
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.mrope import MultimodalRotary, SectionedRows
from engine.layers.rotary import RotaryEmbedding
from engine.sampling.params import SamplingParams
from scheduler import NewRequestData
from tests.engine.qwen_vl_factories import (
    IMAGE_TOKEN_ID,
    hf_greedy,
    hf_inputs,
    hf_reference,
    make_tiny_qwen_vl_dir,
    qwen_chat_text,
)
from tests.engine.references import assert_idle, make_llm
from tests.engine.vision_factories import data_url, random_image

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
# two grids of their own shapes: 3 x 3 and 4 x 2 merged patches (rows and columns differ on the second)
FIRST, SECOND = (1, 64, 48), (2, 30, 60)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_dir(request, tmp_path_factory):
    return make_tiny_qwen_vl_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def llm(qwen_dir):
    return make_llm(qwen_dir)


def generate(llm, parts):
    """The result for one user turn of `parts` (strings are text, anything else an image), and its prompt text."""
    text = qwen_chat_text(parts)
    images = [part for part in parts if not isinstance(part, str)]
    prompt = {"prompt": text, "multi_modal_data": {"image": images}} if images else text
    [result] = llm.generate(prompt, GREEDY, use_tqdm=False)
    return result, text, images


def assert_matches_hf(model_dir, result, text, images):
    assert result.prompt_token_ids == hf_inputs(model_dir, text, images)["input_ids"][0].tolist()
    tokens, logprobs = hf_greedy(model_dir, text, images, MAX_TOKENS)
    assert result.outputs[0].token_ids == tokens
    served = torch.tensor([entry.logprob for entry in result.outputs[0].logprobs])
    torch.testing.assert_close(served, torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_images_and_text_match_hf(llm, qwen_dir):
    """One image, two of different grids, text alone; decode steps run fused at their shifted positions."""
    fused = llm.engine.runner.model.fused
    assert fused is not None  # (the tiny float32 model on the cpu backend)
    calls = []
    forward = fused.forward
    fused.forward = lambda *args: calls.append(1) or forward(*args)
    try:
        for parts, placeholders in (
            ([random_image(*FIRST), "What is it?"], 9),
            (["Compare", random_image(*FIRST), "with", random_image(*SECOND), "please."], 17),
            (["Just text."], 0),
        ):
            result, text, images = generate(llm, parts)
            assert result.prompt_token_ids.count(IMAGE_TOKEN_ID) == placeholders
            assert_matches_hf(qwen_dir, result, text, images)
    finally:
        del fused.forward
    assert len(calls) >= 3 * (MAX_TOKENS - 1)
    assert_idle(llm)


def test_chat_renders_qwens_vision_tokens(llm, qwen_dir):
    image = random_image(5)
    part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    [result] = llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "And this?"}]}], GREEDY)
    assert_matches_hf(qwen_dir, result, qwen_chat_text([image, "And this?"]), [image])


def test_rotary_positions_are_hfs(llm, qwen_dir):
    """The processor's placement (each image's (t, h, w) positions, text shifted after it) is get_rope_index's."""
    images = [random_image(*FIRST), random_image(*SECOND)]
    text = qwen_chat_text(["Compare", images[0], "with", images[1], "please."])
    token_ids, multi_modal = llm.engine.processor.process(text, images)
    served = torch.tensor([[p + multi_modal.rope_shift(p)] * 3 for p in range(len(token_ids))])
    for image in multi_modal.images:
        served[image.start : image.end] = image.rope_positions
    inputs = hf_inputs(qwen_dir, text, images)
    expected, delta = hf_reference(str(qwen_dir))[0].model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    assert torch.equal(served.T, expected[:, 0])
    assert multi_modal.rope_shift(len(token_ids)) == int(delta) < 0


def test_sectioned_rotation_is_hfs():
    """Rows at three-component positions rotated through a step's own tables as HF's M-RoPE rotates them."""
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    config = Qwen2VLTextConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope_parameters)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 200, (3, 1, 12), generator=generator)  # [3, batch, T]
    positions[:, :, :4] = positions[0, :, :4]  # (text rows: three equal components)
    x = torch.randn(1, 4, 12, 16, generator=generator)  # [batch, heads, T, head_dim]
    cos, sin = Qwen2VLRotaryEmbedding(config)(x, positions)
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    rope = RotaryEmbedding(16, 256, 10000.0, None, torch.float32, torch.device("cpu"))
    sectioned = SectionedRows(torch.arange(4, 12), positions[:, 0, 4:].T)
    tables, rows = MultimodalRotary((2, 3, 3), rope).step_tables(rope, positions[0, 0], sectioned)
    ops = TorchLayerOps()
    served = ops.rotary(x[0].transpose(0, 1), ops.rotary_angles(rows, tables), tables)  # [T, heads, head_dim]
    torch.testing.assert_close(served, expected[0].transpose(0, 1), atol=1e-5, rtol=0)


def test_chunks_end_inside_images(qwen_dir):
    """Chunks of 7 tokens: each image is encoded once and taken in parts, each part's rows rotated by section."""
    llm = make_llm(qwen_dir, max_num_batched_tokens=7, max_num_seqs=4)
    result, text, images = generate(llm, ["Compare", random_image(*FIRST), "with", random_image(*SECOND), "please."])
    _, multi_modal = llm.engine.processor.process(text, images)
    for image in multi_modal.images:
        assert any(image.start < boundary < image.end for boundary in range(0, len(result.prompt_token_ids), 7))
    assert_matches_hf(qwen_dir, result, text, images)
    assert_idle(llm)


def test_the_prefix_cache_keys_blocks_by_their_images(llm, qwen_dir):
    first, other = random_image(3, 64, 48), random_image(4, 64, 48)  # (the same grid: the same placeholders)
    a, text, _ = generate(llm, [first, "Describe it in detail."])
    b, _, _ = generate(llm, [other, "Describe it in detail."])
    again, _, _ = generate(llm, [first, "Describe it in detail."])
    image_start = a.prompt_token_ids.index(IMAGE_TOKEN_ID)
    image_end = image_start + a.prompt_token_ids.count(IMAGE_TOKEN_ID)
    assert b.prompt_token_ids == a.prompt_token_ids
    assert b.num_cached_tokens <= image_start  # no block holding one of the image's placeholders is shared
    assert again.num_cached_tokens > image_end  # a hit past the image: the rest computed at shifted positions
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    assert_matches_hf(qwen_dir, b, text, [other])
    assert_matches_hf(qwen_dir, again, text, [first])


def test_a_preempted_request_resumes_with_its_images(qwen_dir):
    """A pool too small for the batch: requests are preempted mid-output and recomputed, images and all."""
    llm = make_llm(qwen_dir, num_blocks=20, max_num_batched_tokens=32)
    images = [random_image(20 + i, 40 + 10 * i, 70 - 10 * i) for i in range(4)]
    texts = [qwen_chat_text([image, f"Picture {i}?"]) for i, image in enumerate(images)]
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in zip(texts, images)]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    for result, text, image in zip(results, texts, images):
        assert_matches_hf(qwen_dir, result, text, [image])
    assert_idle(llm)


def test_the_step_message_carries_the_rotary_positions(llm):
    """What a worker process receives pickles with each image's rotary positions and shift."""
    image = random_image(11)
    _, multi_modal = llm.engine.processor.process(qwen_chat_text([image]), [image])
    data = NewRequestData("r", [1, 2, 3], 3, ((0,),), 0, multi_modal=multi_modal)
    [original], [restored] = data.multi_modal.images, pickle.loads(pickle.dumps(data)).multi_modal.images
    assert torch.equal(restored.rope_positions, original.rope_positions)
    assert restored.rope_shift == original.rope_shift < 0
    torch.testing.assert_close(restored.data["image_grid_thw"], original.data["image_grid_thw"])


def test_images_without_rotary_positions_are_refused(llm):
    image = random_image(12)
    token_ids, multi_modal = llm.engine.processor.process(qwen_chat_text([image]), [image])
    bare = dataclasses.replace(
        multi_modal, images=tuple(dataclasses.replace(i, rope_positions=None) for i in multi_modal.images)
    )
    with pytest.raises(InvalidParameterError, match="multimodal RoPE"):
        llm.engine.add_request("bare", token_ids, GREEDY, multi_modal=bare)
    assert_idle(llm)


def test_tied_embeddings(tmp_path):
    """Qwen2-VL-2B ties its LM head to the embeddings: the whole config says so, the text config may not."""
    model_dir = make_tiny_qwen_vl_dir(tmp_path / "tied", tied=True)
    llm = make_llm(model_dir)
    result, text, images = generate(llm, [random_image(6), "Tied?"])
    assert_matches_hf(model_dir, result, text, images)
