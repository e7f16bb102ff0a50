"""The offline API: `LLM.generate` / `LLM.chat` inputs, ordering, n > 1, stops, logprobs."""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from engine.outputs import Logprob, PositionLogprobs
from scheduler import RequestRejectedError
from tests.engine.references import assert_idle


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def idle_after(llm):
    yield
    assert_idle(llm)


def greedy(max_tokens: int = 6, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def token_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def generate(llm, prompts, params=None):
    return llm.generate(prompts, params, use_tqdm=False)


def alone(llm, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    (result,) = generate(llm, {"prompt_token_ids": prompt_ids}, params)
    return result.outputs[0].token_ids


# ---------------------------------------------------------------------- prompt forms


def test_import_path():
    import engine
    from engine import LLM
    from engine.llm import LLM as ModuleLLM

    assert LLM is ModuleLLM
    assert set(engine.__all__) >= {"LLM", "SamplingParams"}


def test_single_string(llm):
    (result,) = generate(llm, "Hello, world!", greedy())
    tokenizer = llm.get_tokenizer()
    assert result.prompt == "Hello, world!"
    assert result.prompt_token_ids == tokenizer.encode("Hello, world!")
    (out,) = result.outputs
    assert out.index == 0 and len(out.token_ids) == 6
    assert out.text == tokenizer.decode(out.token_ids)
    assert out.token_ids == alone(llm, result.prompt_token_ids, greedy())


def test_list_of_strings(llm):
    prompts = ["The quick brown fox", "Once upon a time", "Hello"]
    results = generate(llm, prompts, greedy())
    tokenizer = llm.get_tokenizer()
    assert [r.prompt for r in results] == prompts
    assert [r.prompt_token_ids for r in results] == [tokenizer.encode(p) for p in prompts]


def test_single_list_of_token_ids(llm):
    prompt_ids = token_prompt(1, 9)
    (result,) = generate(llm, prompt_ids, greedy())
    assert result.prompt is None and result.prompt_token_ids == prompt_ids
    assert result.outputs[0].token_ids == alone(llm, prompt_ids, greedy())


def test_list_of_token_id_lists(llm):
    prompts = [token_prompt(2, 5), token_prompt(3, 1), token_prompt(4, 17)]
    results = generate(llm, prompts, greedy())
    assert [r.prompt_token_ids for r in results] == prompts
    assert all(r.prompt is None for r in results)


def test_prompt_token_ids_dicts(llm):
    prompts = [{"prompt_token_ids": token_prompt(5, 6)}, {"prompt_token_ids": token_prompt(6, 3)}]
    results = generate(llm, prompts, greedy())
    assert [r.prompt_token_ids for r in results] == [p["prompt_token_ids"] for p in prompts]
    (single,) = generate(llm, prompts[0], greedy())
    assert single.prompt_token_ids == prompts[0]["prompt_token_ids"]
    assert single.outputs[0].token_ids == results[0].outputs[0].token_ids


def test_results_come_back_in_input_order(llm):
    """24 prompts (more than max_num_seqs) finishing in a different order than submitted."""
    prompts = [token_prompt(100 + i, 2 + (i * 5) % 19) for i in range(24)]
    max_tokens = [1 + (i * 11) % 17 for i in range(24)]  # the later ones often finish first
    params = [greedy(n) for n in max_tokens]
    results = generate(llm, [{"prompt_token_ids": p} for p in prompts], params)
    assert [r.prompt_token_ids for r in results] == prompts
    assert [len(r.outputs[0].token_ids) for r in results] == max_tokens
    assert len({r.request_id for r in results}) == len(results)
    for i in (0, 7, 23):  # batching does not change what each prompt gets
        assert results[i].outputs[0].token_ids == alone(llm, prompts[i], params[i])


# ---------------------------------------------------------------------- sampling params


def test_one_params_object_applies_to_every_prompt(llm):
    results = generate(llm, [token_prompt(7, 4), token_prompt(8, 8)], greedy(5))
    assert [len(r.outputs[0].token_ids) for r in results] == [5, 5]


def test_default_params(llm):
    (result,) = generate(llm, token_prompt(9, 4))
    assert 1 <= len(result.outputs[0].token_ids) <= 16  # SamplingParams() default max_tokens


def test_params_list_length_mismatch_raises(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        generate(llm, ["a", "b", "c"], [greedy(), greedy()])
    assert llm.engine.num_unfinished_requests == 0


def test_a_rejected_prompt_in_a_batch_leaves_nothing_behind(llm):
    too_long = token_prompt(10, 250)
    with pytest.raises(RequestRejectedError) as info:
        generate(llm, [token_prompt(11, 4), too_long], greedy(16))
    assert info.value.field == "max_tokens"


def test_n_children_have_indexes_and_are_reproducible(llm):
    prompt_ids = token_prompt(12, 10)
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    (first,) = generate(llm, [prompt_ids], params)
    (second,) = generate(llm, [prompt_ids], params)
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in first.outputs)
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1  # children use different seeds
    # Child i samples with seed + i.
    child = SamplingParams(n=1, temperature=1.0, seed=1235, max_tokens=8, ignore_eos=True)
    assert alone(llm, prompt_ids, child) == first.outputs[1].token_ids


def test_max_tokens_finishes_with_length(llm):
    (result,) = generate(llm, "Hello", greedy(7))
    (out,) = result.outputs
    assert out.finish_reason == "length" and out.stop_reason is None
    assert len(out.token_ids) == 7


def test_eos_finishes_with_stop(llm):
    params = SamplingParams(max_tokens=5, temperature=0, logit_bias={2: 100.0})  # force eos (id 2)
    (result,) = generate(llm, "Hello", params)
    (out,) = result.outputs
    assert out.finish_reason == "stop" and len(out.token_ids) == 1
    assert out.text == ""


# ---------------------------------------------------------------------- stop strings


def reference_text(llm, prompt: str, max_tokens: int = 20) -> str:
    (result,) = generate(llm, prompt, greedy(max_tokens))
    return result.outputs[0].text


def pick_stop(text: str) -> str:
    """A two-character alphanumeric ASCII piece past the start of the text."""
    return next(
        text[i : i + 2] for i in range(3, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].isalnum()
    )


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_text(llm, include):
    prompt = "The quick brown fox"
    full = reference_text(llm, prompt)
    stop = pick_stop(full)
    at = full.find(stop)
    params = greedy(20, stop=[stop, "never-generated"], include_stop_str_in_output=include)
    (result,) = generate(llm, prompt, params)
    (out,) = result.outputs
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == (full[: at + len(stop)] if include else full[:at])
    assert len(out.token_ids) < 20


def test_stop_string_not_generated_runs_to_length(llm):
    full = reference_text(llm, "Once upon a time", 10)
    (result,) = generate(llm, "Once upon a time", greedy(10, stop=["never-generated"]))
    assert result.outputs[0].finish_reason == "length"
    assert result.outputs[0].text == full


# ---------------------------------------------------------------------- logprobs


def test_logprobs_two_alternatives_per_token(llm):
    (result,) = generate(llm, "Hello, world!", greedy(6, logprobs=2))
    (out,) = result.outputs
    assert len(out.logprobs) == len(out.token_ids) == 6
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert isinstance(lp, PositionLogprobs)
        assert lp.token_id == token_id and lp.logprob <= 0.0
        assert len(lp.top) == 2
        assert lp.top[0][1] >= lp.top[1][1]
        assert lp.rank == 1 and lp.top[0] == (token_id, pytest.approx(lp.logprob))  # greedy: the top token


def test_logprobs_read_as_vllms_offline_api_gives_them(llm):
    """vLLM's CompletionOutput.logprobs: per token a dict token id -> Logprob(logprob, rank, decoded_token), the
    chosen token first, then the top alternatives (code ported from vLLM called .items() on a named tuple)."""
    tokenizer = llm.get_tokenizer()
    (result,) = generate(llm, "Hello, world!", SamplingParams(max_tokens=5, temperature=1.0, seed=7, logprobs=3))
    (out,) = result.outputs
    for token_id, position in zip(out.token_ids, out.logprobs):
        assert next(iter(position)) == token_id and len(position.top) == 3
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        assert position[token_id] == Logprob(position.logprob, position.rank, text)
        others = {t: (lp.logprob, lp.rank) for t, lp in position.items() if t != token_id}
        assert others == {t: (v, rank) for rank, (t, v) in enumerate(position.top, 1) if t != token_id}
    (prompted,) = generate(llm, "Hello, world!", greedy(1, prompt_logprobs=1))
    assert prompted.prompt_logprobs[0] is None
    for token_id, position in zip(prompted.prompt_token_ids[1:], prompted.prompt_logprobs[1:]):
        assert position[token_id].logprob == position.logprob and 1 <= len(position) <= 2


def test_logprobs_zero_gives_only_the_sampled_token(llm):
    (result,) = generate(llm, "Hello", greedy(3, logprobs=0))
    assert [lp.top for lp in result.outputs[0].logprobs] == [[], [], []]
    assert [list(lp) for lp in result.outputs[0].logprobs] == [[t] for t in result.outputs[0].token_ids]
    (plain,) = generate(llm, "Hello", greedy(3))
    assert plain.outputs[0].logprobs is None


def test_prompt_logprobs(llm):
    prompt_ids = token_prompt(13, 11)
    (result,) = generate(llm, [prompt_ids], greedy(2, prompt_logprobs=1))
    lps = result.prompt_logprobs
    assert len(lps) == len(prompt_ids)
    assert lps[0] is None
    assert [lp.token_id for lp in lps[1:]] == prompt_ids[1:]
    assert all(isinstance(lp, PositionLogprobs) and len(lp.top) == 1 and lp.logprob <= 0.0 for lp in lps[1:])
    assert all(lp.top[0][1] >= lp.logprob - 1e-6 for lp in lps[1:])


# ---------------------------------------------------------------------- chat


SYSTEM = {"role": "system", "content": "You are terse."}


def chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def test_chat_one_conversation(llm):
    conversation = [SYSTEM, {"role": "user", "content": "Hello, world!"}]
    (result,) = llm.chat(conversation, greedy(5), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert result.prompt == chatml(conversation)
    assert result.prompt == tokenizer.hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert result.prompt_token_ids == tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    # as HF's method is called through vLLM's get_tokenizer()
    assert tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == result.prompt
    assert result.prompt_token_ids.count(1) == 3  # <|im_start|> is one special token
    assert result.prompt_token_ids.count(2) == 2  # and so is <|im_end|>
    assert len(result.outputs[0].token_ids) == 5
    assert result.outputs[0].token_ids == alone(llm, result.prompt_token_ids, greedy(5))


def test_chat_list_of_conversations(llm):
    conversations = [
        [{"role": "user", "content": "Once upon a time"}],
        [
            SYSTEM,
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "How are you?"},
        ],
    ]
    results = llm.chat(conversations, [greedy(3), greedy(4)], use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert [r.prompt for r in results] == [chatml(c) for c in conversations]
    assert [r.prompt_token_ids for r in results] == [
        tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations
    ]
    assert [len(r.outputs[0].token_ids) for r in results] == [3, 4]


def test_chat_without_generation_prompt(llm):
    conversation = [{"role": "user", "content": "Hi"}]
    (result,) = llm.chat(conversation, greedy(2), use_tqdm=False, add_generation_prompt=False)
    assert result.prompt == "<|im_start|>user\nHi<|im_end|>\n"


def test_chat_takes_text_parts(llm):
    """OpenAI's content parts, joined by newlines as the server joins them."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "world!"}]}]
    (result,) = llm.chat(parts, greedy(2), use_tqdm=False)
    assert result.prompt == chatml([{"role": "user", "content": "Hello,\nworld!"}])
    with pytest.raises(ValueError, match="image_url"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)
    with pytest.raises(TypeError, match="conversation"):
        llm.chat("hello", use_tqdm=False)


PARTS_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}:{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}[{{ part.text }}]{% endfor %}{% endif %};{% endfor %}"
    "{% if add_generation_prompt %}>{% if terse is defined %}terse{% endif %}{% endif %}"
)


def test_chat_takes_vllms_template_arguments(llm):
    """chat_template, chat_template_content_format (auto: read from the template), continue_final_message and
    chat_template_kwargs, as vLLM's LLM.chat takes them."""
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
    ]
    prompt = lambda **kwargs: llm.chat(parts, greedy(1), use_tqdm=False, **kwargs)[0].prompt  # noqa: E731
    assert prompt(chat_template=PARTS_TEMPLATE) == "user:[a][b];assistant:[c];>"
    assert prompt(chat_template=PARTS_TEMPLATE, chat_template_content_format="string") == "user:a\nb;assistant:c;>"
    assert prompt(chat_template=PARTS_TEMPLATE, chat_template_kwargs={"terse": 1}) == "user:[a][b];assistant:[c];>terse"
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set tools"):
        prompt(chat_template_kwargs={"tools": []})
    continued = prompt(add_generation_prompt=False, continue_final_message=True)
    assert continued == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\nc"


@pytest.mark.parametrize(
    "prompts, params, error",
    [
        ("a", {"max_tokens": 3}, TypeError),
        ("a", [{"max_tokens": 3}], TypeError),
        ({"foo": 1}, None, ValueError),
        ([[1, "a"]], None, TypeError),
    ],
)
def test_bad_arguments_are_clear_errors(llm, prompts, params, error):
    with pytest.raises(error, match="prompt|SamplingParams|sampling_params"):
        generate(llm, prompts, params)


def test_numpy_token_ids_are_prompts(llm):
    import numpy as np

    ids = token_prompt(11, 12)
    expected = alone(llm, ids, greedy(3))
    for prompt in (np.array(ids), [np.array(ids)], {"prompt_token_ids": np.array(ids, dtype=np.int32)}):
        (result,) = generate(llm, prompt, greedy(3))
        assert result.prompt_token_ids == ids and result.outputs[0].token_ids == expected


def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match="scheduling_policy"):
        llm.generate(["a"], greedy(2), priority=[5], use_tqdm=False)
    generate(llm, ["a"], greedy(1))


def test_a_call_cut_short_leaves_nothing_behind(llm):
    """Ctrl-C in a notebook: the interrupted call's requests end, and the next call runs as if it had not been."""
    engine = llm.engine
    step, calls = engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            generate(llm, ["Hello there", "Once upon a time"], greedy(30))
    finally:
        del engine.step
    (result,) = generate(llm, ["The capital of France is"], greedy(4))
    assert len(result.outputs[0].token_ids) == 4
    assert result.outputs[0].token_ids == alone(llm, result.prompt_token_ids, greedy(4))

    # cut inside the step's completion, after the scheduler ended the requests and before their outputs were made
    process = engine._process

    def finishing_interrupted(step_output, logprobs, now):
        if step_output.status.finish_reason is not None:
            raise KeyboardInterrupt
        return process(step_output, logprobs, now)

    engine._process = finishing_interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            generate(llm, ["Hello there", "Once upon a time"], greedy(3))
    finally:
        del engine._process
    assert engine.unfinished_request_ids() == []  # (their states were left behind)


def test_a_failed_sequence_says_why(llm):
    """finish_reason "error" offline carries its reason, as the server's error message does."""

    class NaNLogits:
        def on_logits(self, logits, request_ids):
            logits[:, 7] = float("nan")

        def on_detokenize(self, request_id):
            pass

    llm.engine.fault_injector = NaNLogits()
    try:
        (result,) = generate(llm, ["Hello"], greedy(3))
    finally:
        llm.engine.fault_injector = None
    (output,) = result.outputs
    assert output.finish_reason == "error" and output.error is not None and "finite" in output.error


# ---------------------------------------------------------------------- construction


def test_vllms_newer_name_of_swap_space():
    from engine.llm import engine_config_from_kwargs

    assert engine_config_from_kwargs(None, kv_offloading_size=1.5).cache.swap_space == 1.5
    with pytest.raises(TypeError, match="both"):
        engine_config_from_kwargs(None, kv_offloading_size=1.5, swap_space=2)


def test_vllm_settings_of_what_the_engine_always_does():
    """vLLM scripts pass these; taken when they ask for what this engine does, refused otherwise."""
    from engine.llm import engine_config_from_kwargs

    engine_config_from_kwargs(None, enable_chunked_prefill=True, tokenizer_mode="auto", disable_log_stats=True)
    assert engine_config_from_kwargs(None, distributed_executor_backend=None, max_num_seqs=None).scheduler.max_num_seqs
    for key, value in (("enable_chunked_prefill", False), ("tokenizer_mode", "slow"), ("disable_log_stats", False)):
        with pytest.raises(ValueError, match=key):
            engine_config_from_kwargs(None, **{key: value})


def test_vllm_llm_arguments_that_ask_for_what_the_engine_does():
    """Arguments of vLLM's LLM() that scripts pass at their defaults are taken (they were TypeErrors); a value asking
    for something this engine does not do is a ValueError naming it; vLLM's name of the block count sets it."""
    from engine.llm import engine_config_from_kwargs

    engine_config_from_kwargs(
        None,
        skip_tokenizer_init=False,
        tokenizer_revision=None,
        cpu_offload_gb=0,
        load_format="auto",
        task="generate",
        runner="auto",
        logprobs_mode="raw_logprobs",
        disable_sliding_window=False,
        enable_sleep_mode=False,
        data_parallel_size=1,
        expert_placement_strategy="linear",
        enable_eplb=False,
        calculate_kv_scales=False,
        compilation_config=0,
        disable_custom_all_reduce=True,
        served_model_name="my-model",
    )
    assert engine_config_from_kwargs(None, num_gpu_blocks_override=64).cache.num_blocks == 64
    # vLLM's older task, as its runner and conversion (vLLM's examples still write LLM(model, task="classify"))
    for task, runner, convert in (
        ("embed", "pooling", "auto"),
        ("classify", "pooling", "classify"),
        ("score", "pooling", "auto"),
    ):
        model = engine_config_from_kwargs(None, task=task).model
        assert (model.runner, model.convert) == (runner, convert)
    for key, value in (
        ("load_format", "dummy"),
        ("cpu_offload_gb", 4),
        ("task", "reward"),
        ("compilation_config", {"level": 3}),
        ("tokenizer_revision", "v2"),
        ("data_parallel_size", 2),
        ("expert_placement_strategy", "round_robin"),
        ("enable_eplb", True),
    ):
        with pytest.raises(ValueError, match=key):
            engine_config_from_kwargs(None, **{key: value})


def test_unknown_keyword_raises_type_error(tiny_llama_dir):
    from engine import LLM

    with pytest.raises(TypeError, match="no_such_option"):
        LLM(str(tiny_llama_dir), no_such_option=1)


# ---------------------------------------------------------------------- allowed_token_ids, bad_words


def _contains(ids: list[int], sequence: list[int]) -> bool:
    return any(ids[i : i + len(sequence)] == sequence for i in range(len(ids) - len(sequence) + 1))


def test_allowed_token_ids_are_the_only_tokens_written(llm):
    """Greedy under allowed_token_ids is the argmax among them: with the reference's own tokens allowed the output
    is the reference; with its first token taken out, every token is still among those allowed."""
    prompt = "The quick brown fox"
    (reference,) = generate(llm, prompt, greedy(12))
    ids = reference.outputs[0].token_ids
    (same,) = generate(llm, prompt, greedy(12, allowed_token_ids=sorted(set(ids))))
    assert same.outputs[0].token_ids == ids
    allowed = sorted((set(range(200, 400)) | set(ids[1:])) - {ids[0]})
    (other,) = generate(llm, prompt, greedy(12, allowed_token_ids=allowed))
    out = other.outputs[0].token_ids
    assert out[0] != ids[0] and set(out) <= set(allowed)


def test_bad_words_are_never_written(llm):
    """A word of the greedy reference (one of its tokens' text), banned: the output is the reference until the
    word's last token was due, and neither of its token sequences (as a text's start, and after a space) appears
    in it."""
    prompt = "The quick brown fox"
    (reference,) = generate(llm, prompt, greedy(24))
    ids = reference.outputs[0].token_ids
    tokenizer = llm.get_tokenizer()
    pieces = [tokenizer.decode([t]).strip() for t in ids[2:]]
    word = next(p for p in pieces if p.isascii() and p.isalpha() and len(p) >= 2)
    sequences = [
        tokenizer.encode(word, add_special_tokens=False),
        tokenizer.encode(" " + word, add_special_tokens=False),
    ]
    assert any(_contains(ids, s) for s in sequences), (word, sequences, ids)
    (banned,) = generate(llm, prompt, greedy(24, bad_words=[word]))
    out = banned.outputs[0].token_ids
    assert not any(_contains(out, s) for s in sequences), (word, out)
    start = min(i for s in sequences for i in range(len(ids)) if ids[i : i + len(s)] == s)
    last = max(len(s) for s in sequences if _contains(ids, s))
    assert out[: start + last - 1] == ids[: start + last - 1]  # unchanged until the word's last token was due


@pytest.mark.parametrize(
    "changes, param",
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids"),
        ({"bad_words": ["ok", "  "]}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),
    ],
)
def test_token_masks_refused_name_their_field(llm, changes, param):
    with pytest.raises(RequestRejectedError) as info:
        llm.engine.add_request("bad", [3, 4, 5], greedy(4, **changes))
    assert info.value.field == param


def test_cache_salt_in_a_prompt_dict_keeps_cache_hits_apart(llm):
    prompt = token_prompt(7, 40)
    stats = llm.engine.stats
    generate(llm, {"prompt_token_ids": prompt, "cache_salt": "a"}, greedy(1))
    before = stats().prefix_cache_hits
    generate(llm, {"prompt_token_ids": prompt, "cache_salt": "b"}, greedy(1))
    assert stats().prefix_cache_hits == before
    generate(llm, {"prompt_token_ids": prompt, "cache_salt": "a"}, greedy(1))
    assert stats().prefix_cache_hits > before


def test_bad_words_token_ids_are_the_engines_own(llm):
    """vLLM's _bad_words_token_ids: made by the engine from bad_words, never taken from the caller (an empty or
    negative id would fail the request or mask a token counted from the vocabulary's end)."""
    with pytest.raises(RequestRejectedError) as info:
        llm.engine.add_request("bad", [3, 4, 5], greedy(4, bad_words_token_ids=[[-1]]))
    assert info.value.field == "bad_words_token_ids"
