"""Gemma 3 with images (Gemma3ForConditionalGeneration: SigLIP, the pooling projector, the gemma3_text language
model) against HF transformers on the same tiny random checkpoint, float32 greedy: tokens identical, logprobs
within 1e-4. An image's tokens attend to each other both ways during the prompt (sliding layers too, within their
window; the tiny model's window of 8 is shorter than its 16-token images), so each image is computed in one step:
chunks end at image boundaries, prefix-cache hits stop before an image, a preempted request recomputes its images
whole, an image longer than a step is refused; the cpu and torch backends compute the mask, a causal-only backend
(flash's and triton's case) has those steps run through the torch backend."""

from __future__ import annotations

import pytest
import torch

from engine.attention.layer_attention import FEATURES, SINKS
from engine.attention.step_metadata import check_causal
from engine.attention.torch_backend import TorchAttentionBackend
from engine.errors import SettingsConflictError
from engine.sampling.params import SamplingParams
from scheduler import MediaSpanTooLongError, SchedulerOutput
from tests.engine.gemma3_factories import (
    IMAGE_ID,
    TOKENS_PER_IMAGE,
    chat_text,
    hf_greedy,
    hf_prompt_logprobs,
    make_tiny_gemma3_dir,
)
from tests.engine.references import assert_idle, make_llm
from tests.engine.vision_factories import random_image

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return make_tiny_gemma3_dir(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def llm(gemma3_dir):
    return make_llm(gemma3_dir)


def assert_matches_hf(model_dir, result, text, images):
    out = result.outputs[0]
    tokens, logprobs = hf_greedy(model_dir, text, images, len(out.token_ids))
    assert out.token_ids == tokens
    served = torch.tensor([entry.logprob for entry in out.logprobs])
    torch.testing.assert_close(served, torch.tensor(logprobs), atol=1e-4, rtol=0)


def image_spans(token_ids) -> list[tuple[int, int]]:
    """The runs of image tokens of a prompt: its images' (start, end)."""
    spans, start = [], None
    for position, token in enumerate([*token_ids, -1]):
        if token == IMAGE_ID and start is None:
            start = position
        elif token != IMAGE_ID and start is not None:
            spans.append((start, position))
            start = None
    return spans


def record_steps(llm) -> list[SchedulerOutput]:
    """The step messages the runner executes from now on."""
    runner, steps = llm.engine.runner, []
    execute = runner.execute

    def recording(output: SchedulerOutput):
        steps.append(output)
        return execute(output)

    runner.execute = recording
    return steps


class CausalOnlyBackend(TorchAttentionBackend):
    """The torch backend posing as one that computes causal attention only (flash's and triton's case): a step
    with bidirectional spans reaching it fails (check_causal)."""

    name = "causal-only"
    attention_features = (*FEATURES, SINKS)

    def build_metadata(self, step, spec):
        check_causal(step, self.name)
        return super().build_metadata(step, spec)


@pytest.mark.parametrize("backend", ["auto", "torch", "causal-only"])
def test_one_image_matches_hf(gemma3_dir, backend, monkeypatch):
    if backend == "causal-only":
        monkeypatch.setattr("engine.platform.get_attention_backend", lambda *args, **kwargs: CausalOnlyBackend())
    llm = make_llm(gemma3_dir, attention_backend="torch" if backend == "causal-only" else backend)
    assert llm.engine.runner.backend.name == {"auto": "cpu"}.get(backend, backend)
    image = random_image(0)
    text = chat_text([image, "What is in the picture?"])
    [result] = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    assert result.prompt_token_ids.count(IMAGE_ID) == TOKENS_PER_IMAGE
    assert_matches_hf(gemma3_dir, result, text, [image])
    assert_idle(llm)


def test_two_images_in_chunks_that_end_at_their_boundaries(gemma3_dir):
    """Steps of 20 tokens (an image is 16): every chunk ends before an image or after it, never inside; every
    prompt position's logprob is HF's."""
    llm = make_llm(gemma3_dir, max_num_batched_tokens=20, max_num_seqs=4)
    steps = record_steps(llm)
    first, second = random_image(1, 64, 48), random_image(2, 30, 60)
    text = chat_text(["Compare", first, "with", second, "please."])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    [result] = llm.generate({"prompt": text, "multi_modal_data": {"image": [first, second]}}, params, use_tqdm=False)
    assert_matches_hf(gemma3_dir, result, text, [first, second])
    served = torch.tensor([entry.logprob for entry in result.prompt_logprobs[1:]])
    torch.testing.assert_close(
        served, torch.tensor(hf_prompt_logprobs(gemma3_dir, text, [first, second])), atol=1e-4, rtol=0
    )
    spans = image_spans(result.prompt_token_ids)
    assert len(spans) == 2
    chunks = [
        (out.num_computed_tokens[rid], out.num_computed_tokens[rid] + n)
        for out in steps
        for rid, n in out.num_scheduled_tokens.items()
    ]
    for start, end in chunks:
        assert not any(first < end < last or first < start < last for first, last in spans), (start, end, spans)
    assert any(end == spans[0][0] for _, end in chunks) and any(start == spans[1][0] for start, _ in chunks)
    assert_idle(llm)


def test_chat_writes_the_image_placeholder(llm, gemma3_dir):
    image = random_image(7)
    parts = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "What is this?"}]
    [result] = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    assert_matches_hf(gemma3_dir, result, chat_text([image, "What is this?"]), [image])


def test_text_alone_matches_hf(llm, gemma3_dir):
    text = chat_text(["Just words, no picture."])
    [result] = llm.generate(text, GREEDY, use_tqdm=False)
    assert_matches_hf(gemma3_dir, result, text, [])


def test_the_prefix_cache_hits_the_same_image_only(llm, gemma3_dir):
    first, other = random_image(3), random_image(4)
    text = chat_text(["Look:", first, "Describe it in a few words."])
    [a] = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)
    [b] = llm.generate({"prompt": text, "multi_modal_data": {"image": other}}, GREEDY, use_tqdm=False)
    [again] = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)
    [(start, end)] = image_spans(a.prompt_token_ids)
    assert 0 < b.num_cached_tokens <= start  # the blocks before the other image only
    assert again.num_cached_tokens >= end  # the image's blocks too
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    assert_matches_hf(gemma3_dir, b, text, [other])
    assert_matches_hf(gemma3_dir, again, text, [first])


def test_a_prefix_hit_stops_before_an_image_it_would_end_inside(llm, gemma3_dir):
    """A prompt whose cached blocks, one token short of the prompt, would end inside its image (the image near the
    prompt's end): the hit stops at the last block at or before the image, which is computed again, whole."""
    image = random_image(5)
    block_size = llm.engine.scheduler.block_size
    for words in ("A", "Ab", "Abc", "Abcd", "Abcde", "Abcdef"):  # (a text that puts the hit's cap in the image)
        text = f"<|im_start|>user\n{words}<start_of_image>"
        token_ids, _ = llm.engine.processor.process(text, [image])
        [(start, end)] = image_spans(token_ids)
        if start < (len(token_ids) - 1) // block_size * block_size < end:
            break
    else:
        raise AssertionError("no prompt puts the hit's cap inside the image")
    [a] = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    [again] = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == start // block_size * block_size
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    assert_matches_hf(gemma3_dir, again, text, [image])


def test_a_preempted_request_recomputes_its_images_whole(gemma3_dir):
    llm = make_llm(gemma3_dir, num_blocks=36, max_num_batched_tokens=32, max_num_seqs=4)
    steps = record_steps(llm)
    images = [random_image(20 + i) for i in range(4)]
    texts = [chat_text([image, f"Picture {i}?"]) for i, image in enumerate(images)]
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in zip(texts, images)]
    longer = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    results = llm.generate(prompts, longer, use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    spans = image_spans(results[0].prompt_token_ids)  # (every prompt places its image alike)
    for out in steps:
        for rid, n in out.num_scheduled_tokens.items():
            start, end = out.num_computed_tokens[rid], out.num_computed_tokens[rid] + n
            assert not any(first < end < last or first < start < last for first, last in spans)
    for result, text, image in zip(results, texts, images):
        assert_matches_hf(gemma3_dir, result, text, [image])
    assert_idle(llm)


def test_an_image_longer_than_a_step_is_refused(gemma3_dir):
    llm = make_llm(gemma3_dir, max_num_batched_tokens=12, max_num_seqs=4)
    image = random_image(6)
    with pytest.raises(MediaSpanTooLongError, match="at least 16"):
        llm.generate({"prompt": chat_text([image]), "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    [result] = llm.generate(chat_text(["Words fit in any step."]), GREEDY, use_tqdm=False)
    assert_matches_hf(gemma3_dir, result, chat_text(["Words fit in any step."]), [])
    assert_idle(llm)


def test_batch_invariant_mode_refuses_its_images(gemma3_dir):
    with pytest.raises(SettingsConflictError, match="both ways"):
        make_llm(gemma3_dir, batch_invariant=True)
    text_only = make_llm(gemma3_dir, batch_invariant=True, limit_mm_per_prompt={"image": 0})
    [result] = text_only.generate(chat_text(["Only text here."]), GREEDY, use_tqdm=False)
    assert_matches_hf(gemma3_dir, result, chat_text(["Only text here."]), [])
