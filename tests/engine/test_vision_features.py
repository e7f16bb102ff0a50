"""What docs/models.md says a vision-language model keeps of its language model's features, checked on the tiny
LLaVA with images: the fused bf16 decode step (the unfused path's tokens and logprobs, bit for bit), speculative
decoding with n-gram drafts and with draft models (the LLaVA's own language model, and a text model of its
vocabulary: the greedy tokens and logprobs of no speculation), LoRA on the language model's projections (PEFT's
merged LlavaForConditionalGeneration's tokens; an adapter of the vision tower refused), an abort in the middle of
an image (the KV cache and the runner empty, and the blocks it cached hit by the next request inside the image),
a decode step on an image's token beside the decode graphs (eager: HF's tokens)."""

from __future__ import annotations

import pytest
import torch

from engine import LoRAMix, LoRARequest, SamplingParams
from engine.errors import LoRAAdapterError
from engine.runner.cuda_graphs import EagerReplay, decode_buckets
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import assert_idle, make_llm
from tests.engine.test_fused_decode import _with_product
from tests.engine.vision_factories import chat_text, hf_greedy, make_tiny_llava_dir, random_image

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
IMAGE_TOKEN = 512  # (vision_factories' tokenizer)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava_dir(tmp_path_factory.mktemp("llava-features"))


def image_prompts() -> list[dict]:
    """One image, two images, and an image before text that repeats (n-gram drafts find their loop)."""
    first, second, third = random_image(30), random_image(31, 64, 48), random_image(32, 30, 60)
    return [
        {"prompt": chat_text([first, "What is in the picture?"]), "multi_modal_data": {"image": first}},
        {"prompt": chat_text(["Compare", first, "with", second]), "multi_modal_data": {"image": [first, second]}},
        {"prompt": chat_text([third, "one two three one two three one two"]), "multi_modal_data": {"image": third}},
    ]


def outputs(llm, prompts, params=GREEDY) -> list[tuple[list[int], list[float]]]:
    results = llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)
    return [(r.outputs[0].token_ids, [entry.logprob for entry in r.outputs[0].logprobs]) for r in results]


def assert_same(got, expected, abs: float = 1e-5) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=abs)


@pytest.mark.parametrize("product", ["column-blocks", "gemv"])
def test_the_fused_bf16_decode_step_gives_the_unfused_paths_outputs(llava_dir, product, cpu_kernels, monkeypatch):
    """As test_fused_decode.py checks the text models: bf16 on the cpu backend, every decode step fused (the steps
    with image rows run unfused: their input is embeddings, not token ids), bit for bit the unfused path's."""
    _with_product(product, cpu_kernels, monkeypatch)
    llm = make_llm(llava_dir, dtype="bfloat16", attention_backend="cpu", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.fused is not None
    rows: list[int] = []
    forward = model.fused.forward
    monkeypatch.setattr(
        model.fused, "forward", lambda m, ids, *args: rows.append(ids.shape[0]) or forward(m, ids, *args)
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = image_prompts()
    fused = llm.generate(prompts, params, use_tqdm=False)
    assert len(rows) >= MAX_TOKENS - 1 and max(rows) == len(prompts)  # every decode step ran fused
    model.fused = None
    unfused = llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)
    for a, b in zip(fused, unfused, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_ngram_speculation_keeps_the_greedy_outputs(llava_dir):
    prompts = image_prompts()
    expected = outputs(make_llm(llava_dir), prompts)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "step_cost_model": False}
    for overrides in ({}, {"max_num_batched_tokens": 16}):  # (chunks ending inside the images)
        spec = make_llm(llava_dir, speculative_config=ngram, **overrides)
        assert_same(outputs(spec, prompts), expected)
        assert spec.engine.stats().speculation.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def text_draft(llava_dir, tmp_path_factory):
    """A tiny Llama of the LLaVA's vocabulary (its tokenizer, the image token included), other weights."""
    from transformers import AutoTokenizer

    path = make_tiny_model_dir(tmp_path_factory.mktemp("text-draft"), "llama", seed=3, vocab_size=576)
    AutoTokenizer.from_pretrained(str(llava_dir)).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("draft", ["itself", "text model"])
def test_a_draft_model_keeps_the_greedy_outputs(llava_dir, text_draft, draft):
    """The LLaVA drafting for itself (its language model reads the placeholders as tokens: it agrees with the
    target less after an image; drafts accepted and rejected), or a random text model of its vocabulary (drafts
    rejected): the outputs of no speculation, the draft's cache empty at the end."""
    prompts = image_prompts()
    expected = outputs(make_llm(llava_dir), prompts)
    model = llava_dir if draft == "itself" else text_draft
    config = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3, "step_cost_model": False}
    spec = make_llm(llava_dir, speculative_config=config, max_num_batched_tokens=16)
    assert_same(outputs(spec, prompts), expected)
    stats = spec.engine.stats().speculation
    assert 0 < stats.num_accepted_tokens if draft == "itself" else 0 <= stats.num_accepted_tokens
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    proposer = spec.engine.scheduler.proposer
    assert proposer.num_requests == 0 and proposer.cache.num_free_blocks == proposer.cache.num_blocks


def _llava_adapter(llava_dir, out_dir, targets, seed: int):
    """A PEFT LoRA adapter (random A and B) over the whole LlavaForConditionalGeneration, saved to `out_dir`, and
    that model with the adapter merged (merge_and_unload)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    base = LlavaForConditionalGeneration.from_pretrained(str(llava_dir), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, config)
    model.save_pretrained(str(out_dir))
    return model.merge_and_unload().eval()


def _merged_greedy(merged, llava_dir, text, images) -> tuple[list[int], list[float]]:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(llava_dir))
    inputs = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = merged.generate(
            **inputs,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=None,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens)]


def test_lora_on_the_language_model_matches_peft_merged(llava_dir, tmp_path):
    """An adapter of the language model's q and v projections, served with an image beside a base request of
    the same prompt: PEFT's merged model's tokens (logprobs within 1e-4), the base HF's for the other."""
    merged = _llava_adapter(llava_dir, tmp_path / "qv", r".*language_model.*\.(q_proj|v_proj)", seed=1)
    image = random_image(33)
    text = chat_text([image, "What is in the picture?"])
    llm = make_llm(llava_dir, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_batched_tokens=16)
    llm.engine.lora_manager.add_lora(LoRARequest("qv", str(tmp_path / "qv")))
    prompt = {"prompt": text, "multi_modal_data": {"image": image}}
    with_adapter, base = llm.generate(
        [prompt, prompt], GREEDY, use_tqdm=False, lora_request=[LoRAMix.single("qv"), None]
    )
    assert_idle(llm)
    tokens, logprobs = _merged_greedy(merged, llava_dir, text, [image])
    assert with_adapter.outputs[0].token_ids == tokens
    assert [e.logprob for e in with_adapter.outputs[0].logprobs] == pytest.approx(logprobs, abs=1e-4)
    assert base.outputs[0].token_ids == hf_greedy(llava_dir, text, [image], MAX_TOKENS)[0] != tokens


def test_an_adapter_of_the_vision_tower_is_refused(llava_dir, tmp_path):
    """q_proj and v_proj match the CLIP tower's projections too: served on the language model alone, such an adapter
    would run the tower's deltas in the language model's layers of the same index."""
    _llava_adapter(llava_dir, tmp_path / "all", ["q_proj", "v_proj"], seed=2)
    llm = make_llm(llava_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match="vision_tower"):
        llm.engine.lora_manager.add_lora(LoRARequest("all", str(tmp_path / "all")))


def test_an_abort_inside_an_image_leaves_nothing_and_its_blocks_serve_the_next_request(llava_dir):
    """Chunks of 16 tokens: the first ends inside the image (its embeddings held for the next chunk), then the
    request is aborted: no KV block held, no request or image left in the runner. Its computed blocks stay cached:
    the same prompt again hits them, a hit that ends inside the image, and gets HF's tokens."""
    llm = make_llm(llava_dir, max_num_batched_tokens=16)
    engine = llm.engine
    image = random_image(34)
    text = chat_text(["Look", image, "What is in the picture?"])
    token_ids, multi_modal = engine.processor.process(text, [image], add_special_tokens=False)
    [placed] = multi_modal.images
    assert placed.start < 16 < placed.end - 4  # (the first chunk ends inside the image, a block short of its end)
    engine.add_request("aborted", token_ids, GREEDY, multi_modal=multi_modal)
    engine.step()
    assert list(engine.runner.requests["aborted"].image_embeds) == [0]  # encoded, held for the next chunk
    engine.abort(["aborted"])
    engine.step()
    assert not engine.runner.requests
    assert_idle(llm)
    [result] = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    assert placed.start < result.num_cached_tokens < placed.end
    assert result.outputs[0].token_ids == hf_greedy(llava_dir, text, [image], MAX_TOKENS)[0]
    assert_idle(llm)


def test_a_decode_step_on_an_images_last_token_runs_eagerly_beside_the_decode_graphs(llava_dir):
    """A prompt that ends with its image, of 4k + 1 tokens: asked again, the prefix cache holds all but its last
    token, which runs as a one-row decode step whose input is the image's last embedding. The decode graphs
    (EagerReplay off CUDA) are captured for one row: that step must not replay one (its graph reads token ids)."""
    image = random_image(35)
    llm = make_llm(llava_dir)
    llm.engine.runner.capture_decode_graphs(decode_buckets(4), EagerReplay)
    text = "Hi there<image>"
    token_ids, _ = llm.engine.processor.process(text, [image], add_special_tokens=True)
    assert len(token_ids) % 4 == 1 and token_ids[-1] == IMAGE_TOKEN
    expected = hf_greedy(llava_dir, text, [image], MAX_TOKENS)[0]  # (the tiny tokenizer adds no BOS)
    prompt = {"prompt": text, "multi_modal_data": {"image": image}}
    graph = llm.engine.runner.graphs._graphs[1]
    [first] = llm.generate(prompt, GREEDY, use_tqdm=False)
    replays = graph.replays
    [again] = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == len(token_ids) - 1
    assert graph.replays - replays == MAX_TOKENS - 1  # every decode step but the image's
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected
    assert_idle(llm)
