"""POST /v1/completions over a real server: the openai SDK, raw httpx and SSE framing, plus the
small endpoints (/v1/models, /tokenize, /detokenize, /version, /health, /openapi.json)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.server.sse_frames import stream_raw as stream_frames

PROMPT = "Hello, world!"
OTHER_PROMPT = "The quick brown fox"


# ------------------------------------------------------------------ helpers


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def async_sdk(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def complete(server, **body) -> dict:
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def greedy_text(server, prompt, max_tokens: int = 12) -> str:
    return complete(server, prompt=prompt, max_tokens=max_tokens, temperature=0)["choices"][0]["text"]


def token_ids(server, text: str) -> list[int]:
    with server.client() as c:
        r = c.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def token_string(server, token_id: int) -> str:
    with server.client() as c:
        r = c.post("/detokenize", json={"tokens": [token_id]})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def stream_raw(server, **body) -> list[dict]:
    return stream_frames(server, "/v1/completions", **body)


def assert_offsets(logprobs: dict, start: int = 0) -> None:
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    assert len(offsets) == len(tokens)
    position = start
    for offset, token in zip(offsets, tokens):
        assert offset == position
        position += len(token)


# ------------------------------------------------------------------ the SDK: prompt forms


def test_sdk_string_prompt(server):
    ids = token_ids(server, PROMPT)
    out = sdk(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == "tiny"
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert isinstance(choice.text, str) and choice.text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (len(ids), 8, len(ids) + 8)
    assert choice.text == greedy_text(server, PROMPT, 8)  # greedy: reproducible


def test_sdk_prompt_forms_agree(server):
    client = sdk(server)
    a, b = greedy_text(server, PROMPT), greedy_text(server, OTHER_PROMPT)
    ids_a, ids_b = token_ids(server, PROMPT), token_ids(server, OTHER_PROMPT)

    strings = client.completions.create(model="tiny", prompt=[PROMPT, OTHER_PROMPT], max_tokens=12, temperature=0)
    assert [c.index for c in strings.choices] == [0, 1]
    assert [c.text for c in strings.choices] == [a, b]
    assert strings.usage.prompt_tokens == len(ids_a) + len(ids_b)
    assert strings.usage.completion_tokens == 24

    one_ids = client.completions.create(model="tiny", prompt=ids_a, max_tokens=12, temperature=0)
    assert [c.text for c in one_ids.choices] == [a]
    assert one_ids.usage.prompt_tokens == len(ids_a)

    many_ids = client.completions.create(model="tiny", prompt=[ids_a, ids_b], max_tokens=12, temperature=0)
    assert [(c.index, c.text) for c in many_ids.choices] == [(0, a), (1, b)]


def test_async_sdk_concurrent_requests(server):
    expected = [greedy_text(server, p, 6) for p in (PROMPT, OTHER_PROMPT, "Once upon a time")]

    async def main():
        async with async_sdk(server) as client:
            outs = await asyncio.gather(
                *(
                    client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
                    for p in (PROMPT, OTHER_PROMPT, "Once upon a time")
                )
            )
            stream = await client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True
            )
            streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        return [o.choices[0].text for o in outs], streamed

    texts, streamed = asyncio.run(main())
    assert texts == expected
    assert streamed == expected[0]


def test_sdk_streaming_matches_non_streaming(server):
    expected = greedy_text(server, PROMPT, 10)
    chunks = list(
        sdk(server).completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == expected
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 10
    assert usage.usage.prompt_tokens == len(token_ids(server, PROMPT))


# ------------------------------------------------------------------ n > 1


def test_n_choices_are_indexed_prompt_index_times_n_plus_i(server):
    a, b = greedy_text(server, PROMPT, 5), greedy_text(server, OTHER_PROMPT, 5)
    out = complete(server, prompt=[PROMPT, OTHER_PROMPT], n=2, max_tokens=5, temperature=0)
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, a), (1, a), (2, b), (3, b)]
    assert out["usage"]["completion_tokens"] == 20
    assert out["usage"]["prompt_tokens"] == len(token_ids(server, PROMPT)) + len(token_ids(server, OTHER_PROMPT))

    chunks = stream_raw(server, prompt=[PROMPT, OTHER_PROMPT], n=2, max_tokens=5, temperature=0)
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            assert choice["index"] not in finished
            finished[choice["index"]] = choice["finish_reason"]
    assert texts == {0: a, 1: a, 2: b, 3: b}
    assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}


def test_n_with_seed_children_differ_and_reproduce(server):
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    first = [c["text"] for c in complete(server, **body)["choices"]]
    again = [c["text"] for c in complete(server, **body)["choices"]]
    assert first == again
    assert len(set(first)) == 3


def test_best_of_equal_to_n_is_accepted(server):
    out = complete(server, prompt=PROMPT, n=2, best_of=2, max_tokens=3, temperature=0)
    assert [c["index"] for c in out["choices"]] == [0, 1]


# ------------------------------------------------------------------ logprobs


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_alternatives(server, k):
    out = complete(server, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=k)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert_offsets(lp)
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert isinstance(token, str) and isinstance(logprob, float) and logprob <= 0
        assert token in top
        assert 1 <= len(top) <= k + 1
        if k == 0:
            assert top == {token: logprob}
        # greedy: the sampled token is the most likely one
        assert logprob >= max(top.values()) - 1e-5
    if "\ufffd" not in choice["text"]:
        assert "".join(lp["tokens"]) == choice["text"]
    plain = complete(server, prompt=PROMPT, max_tokens=6, temperature=0)["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == choice["text"]


def test_logprobs_token_strings_and_offsets(server):
    (underscore,) = token_ids(server, "_")
    out = complete(server, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, logit_bias={str(underscore): 100})
    choice = out["choices"][0]
    assert choice["text"] == "____"
    assert choice["logprobs"]["tokens"] == ["_"] * 4
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3]


def test_top_logprobs_value_of_sampled_token_is_its_logprob(server):
    # Byte-level tokens that are partial UTF-8 all decode to "\ufffd"; the dict must still
    # report the sampled token's own logprob (OpenAI: top_logprobs[token] == token_logprob).
    for prompt in (PROMPT, OTHER_PROMPT, "Hello"):
        lp = complete(server, prompt=prompt, max_tokens=10, temperature=0, logprobs=20)["choices"][0]["logprobs"]
        for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert top[token] == pytest.approx(logprob, abs=1e-6), (prompt, token)


def test_streamed_logprobs_match_non_streamed(server):
    expected = complete(server, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)["choices"][0]["logprobs"]
    chunks = stream_raw(server, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    tokens, values, offsets = [], [], []
    for chunk in chunks:
        lp = chunk["choices"][0]["logprobs"]
        tokens += lp["tokens"]
        values += lp["token_logprobs"]
        offsets += lp["text_offset"]
    assert tokens == expected["tokens"]
    assert offsets == expected["text_offset"]
    assert values == pytest.approx(expected["token_logprobs"], abs=1e-5)


# ------------------------------------------------------------------ echo


def test_echo_alone(server):
    completion = greedy_text(server, PROMPT, 5)
    out = complete(server, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert out["choices"][0]["text"] == PROMPT + completion
    assert out["usage"]["completion_tokens"] == 5

    ids = token_ids(server, OTHER_PROMPT)
    out = complete(server, prompt=[ids], max_tokens=5, temperature=0, echo=True)
    assert out["choices"][0]["text"] == OTHER_PROMPT + greedy_text(server, OTHER_PROMPT, 5)

    streamed = stream_raw(server, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert streamed[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in streamed) == PROMPT + completion


def test_echo_with_logprobs_puts_prompt_tokens_first(server):
    # A prompt no other test sends, so this checks echo without any help from the prefix cache.
    prompt = "A paged key-value cache splits every sequence"
    ids = token_ids(server, prompt)
    n = len(ids)
    out = complete(server, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True)["choices"][0]
    plain = complete(server, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)["choices"][0]
    lp = out["logprobs"]
    assert out["text"] == prompt + plain["text"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 4
    assert lp["tokens"][:n] == [token_string(server, t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # as OpenAI does
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(t in top and len(top) <= 3 for t, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))
    assert_offsets(lp)
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)


def test_echo_prompt_logprobs_are_the_models(server):
    # A token scored as a prompt token gets the logprob it had when it was generated.
    # "Café" is 2 tokens and "Café" + its greedy continuation 3: never a full KV block, never a cache hit.
    prefix = token_ids(server, "Café")
    generated = complete(server, prompt=prefix, max_tokens=1, temperature=0, logprobs=0)["choices"][0]
    ids = token_ids(server, "Café" + generated["text"])
    assert ids[: len(prefix)] == prefix and len(ids) == len(prefix) + 1, "precondition: re-tokenizes alike"
    back = complete(server, prompt=ids, max_tokens=1, temperature=0, logprobs=0, echo=True)["choices"][0]
    scored = back["logprobs"]["token_logprobs"][len(prefix)]
    assert scored == pytest.approx(generated["logprobs"]["token_logprobs"][0], abs=1e-4)
    assert back["logprobs"]["tokens"][len(prefix)] == generated["logprobs"]["tokens"][0]


def test_streamed_echo_with_logprobs(server):
    prompt = "Every morning she opened the shop"
    n = len(token_ids(server, prompt))
    chunks = stream_raw(server, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True)
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(prompt)
    assert first["logprobs"]["token_logprobs"][0] is None
    assert first["logprobs"]["tokens"][:n] == [token_string(server, t) for t in token_ids(server, prompt)]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert len(tokens) == n + 4
    assert_offsets({"tokens": tokens, "text_offset": offsets})
    plain = complete(server, prompt=prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt + plain


def test_echo_logprobs_of_a_cached_prompt(server):
    prompt = "Numbers like 3.14159, 2048 and 65536 were written"
    n = len(token_ids(server, prompt))
    plain = complete(server, prompt=prompt, max_tokens=4, temperature=0, logprobs=1)["choices"][0]  # caches it
    lp = complete(server, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == n + 4
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server):
    """vLLM's echo without generation: the prompt and its logprobs, nothing generated (a prompt scored)."""
    prompt = "Scoring a sentence without a continuation"
    n = len(token_ids(server, prompt))
    with_one = complete(server, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)["choices"][0]
    out = complete(server, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    choice = out["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == n
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n and lp["tokens"] == with_one["logprobs"]["tokens"][:n]
    assert lp["token_logprobs"][1:] == pytest.approx(with_one["logprobs"]["token_logprobs"][1:n], abs=1e-5)
    chunks = stream_raw(server, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == n
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    with server.client() as c:  # without echo there is nothing to return
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# ------------------------------------------------------------------ stop strings


def _stop_candidate(text: str) -> tuple[int, str]:
    """A 2-character stop string first found at k >= 1, with only printable ASCII up to it."""
    for k in range(1, len(text) - 1):
        candidate = text[k : k + 2]
        prefix = text[: k + 2]
        if prefix.isascii() and prefix.isprintable() and not candidate.isspace() and text.find(candidate) == k:
            return k, candidate
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_strings(server):
    full = greedy_text(server, PROMPT, 20)
    k, stop = _stop_candidate(full)
    base = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0}

    out = complete(server, stop=stop, **base)
    choice = out["choices"][0]
    assert choice["text"] == full[:k]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert out["usage"]["completion_tokens"] < 20

    choice = complete(server, stop=["\u2603 never", stop], **base)["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (full[:k], "stop")

    choice = complete(server, stop=[stop], include_stop_str_in_output=True, **base)["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (full[: k + 2], "stop")

    chunks = stream_raw(server, stop=stop, **base)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[:k]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    sdk_out = sdk(server).completions.create(model="tiny", stop=stop, **base)
    assert sdk_out.choices[0].text == full[:k] and sdk_out.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ seeds


def test_seed_reproducibility(server):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "ignore_eos": True}
    one = complete(server, seed=1234, **body)["choices"][0]["text"]
    assert complete(server, seed=1234, **body)["choices"][0]["text"] == one
    via_sdk = sdk(server).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1234, extra_body={"ignore_eos": True}
    )
    assert via_sdk.choices[0].text == one
    other = complete(server, seed=4321, **body)["choices"][0]["text"]
    assert other != one


# ------------------------------------------------------------------ usage in streams


def test_include_usage_final_chunk(server):
    n_prompt = len(token_ids(server, PROMPT))
    chunks = stream_raw(server, prompt=PROMPT, max_tokens=5, temperature=0, stream_options={"include_usage": True})
    *content, last = chunks
    assert last["choices"] == []
    usage = last["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (n_prompt, 5, n_prompt + 5)
    assert all(c["usage"] is None for c in content)
    assert all(c["id"] == last["id"] for c in content)

    without = stream_raw(server, prompt=PROMPT, max_tokens=5, temperature=0)
    assert all(c["choices"] and c["usage"] is None for c in without)

    chunks = stream_raw(
        server, prompt=[PROMPT, OTHER_PROMPT], n=2, max_tokens=3, temperature=0, stream_options={"include_usage": True}
    )
    assert chunks[-1]["usage"]["completion_tokens"] == 12


# ------------------------------------------------------------------ raw SSE framing


def test_sse_framing_and_stream_equals_non_stream(server):
    expected = complete(server, prompt=OTHER_PROMPT, max_tokens=12, temperature=0)["choices"][0]
    chunks = stream_raw(server, prompt=OTHER_PROMPT, max_tokens=12, temperature=0)
    assert len(chunks) >= 2
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert {c["model"] for c in chunks} == {"tiny"}
    assert len({c["created"] for c in chunks}) == 1
    for chunk in chunks:
        assert len(chunk["choices"]) == 1 and chunk["choices"][0]["index"] == 0
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected["text"]


# ------------------------------------------------------------------ vLLM extras


def test_vllm_extras_accepted(server):
    out = complete(
        server,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.8,
        seed=3,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=2,
        ignore_eos=False,
        stop_token_ids=[7],
        skip_special_tokens=True,
        include_stop_str_in_output=False,
        spaces_between_special_tokens=True,
        priority=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="someone",
    )
    assert out["choices"][0]["finish_reason"] in ("length", "stop")
    client = sdk(server)
    via_sdk = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"top_k": 5, "min_tokens": 1}
    )
    assert via_sdk.choices[0].text == greedy_text(server, PROMPT, 3)
    with pytest.raises(openai.BadRequestError) as info:  # fcfs server: a priority would be ignored
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, extra_body={"priority": 1})
    assert info.value.body["param"] == "priority"


@pytest.mark.parametrize("field", ["guided_json", "mm_processor_kwargs", "use_beam_search"])
def test_known_unimplemented_vllm_extras_are_refused(server, field):
    with server.client() as c:
        response = c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, field: {"type": "x"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_eos_handling_ignore_eos_min_tokens_skip_special_tokens(server):
    force_eos = {"2": 100}  # eos id 2 (<|im_end|>) made all but certain
    out = complete(server, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias=force_eos)
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 1
    assert out["choices"][0]["text"] == ""

    out = complete(server, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias=force_eos, ignore_eos=True)
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 5
    assert out["choices"][0]["text"] == ""  # special tokens skipped by default

    out = complete(
        server,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logit_bias=force_eos,
        ignore_eos=True,
        skip_special_tokens=False,
    )
    assert out["choices"][0]["text"] == "<|im_end|>" * 5

    out = complete(server, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=force_eos, min_tokens=3)
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 4


def test_stop_token_ids(server):
    (underscore,) = token_ids(server, "_")
    bias = {str(underscore): 100}
    out = complete(server, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=bias)
    assert out["choices"][0]["finish_reason"] == "length"
    out = complete(server, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=bias, stop_token_ids=[underscore])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == underscore
    assert out["usage"]["completion_tokens"] == 1


def test_sampling_extras_are_effective(server):
    greedy = greedy_text(server, OTHER_PROMPT, 20)
    body = {"prompt": OTHER_PROMPT, "max_tokens": 20, "temperature": 1.0, "seed": 99, "ignore_eos": True}
    assert complete(server, top_k=1, **body)["choices"][0]["text"] == greedy  # top_k 1 is argmax
    assert complete(server, min_p=1.0, **body)["choices"][0]["text"] == greedy  # min_p 1 keeps only the max
    ids = token_ids(server, greedy)
    assert len(set(ids)) < len(ids), "precondition: the greedy text repeats a token"
    penalized = complete(server, prompt=OTHER_PROMPT, max_tokens=20, temperature=0, repetition_penalty=2.0)
    assert penalized["choices"][0]["text"] != greedy


# ------------------------------------------------------------------ other endpoints


def test_models_version_health(server):
    with server.client() as c:
        models = c.get("/v1/models")
        assert models.status_code == 200
        body = models.json()
        assert body["object"] == "list" and len(body["data"]) == 1
        card = body["data"][0]
        assert (card["id"], card["object"], card["max_model_len"]) == ("tiny", "model", 256)
        assert isinstance(card["created"], int)
        version = c.get("/version")
        assert version.status_code == 200 and isinstance(version.json()["version"], str)
        health = c.get("/health")
        assert health.status_code == 200
    assert [m.id for m in sdk(server).models.list()] == ["tiny"]


def test_tokenize_detokenize_round_trip(server):
    text = "Café crème, 東京 🙂 and tokens"
    with server.client() as c:
        r = c.post("/tokenize", json={"model": "tiny", "prompt": text})
        assert r.status_code == 200
        body = r.json()
        assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 256
        assert all(0 <= t < 512 for t in body["tokens"])
        back = c.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": text}
    out = complete(server, prompt=text, max_tokens=1, temperature=0)
    assert out["usage"]["prompt_tokens"] == body["count"]


def test_tokenize_takes_vllms_fields_and_logs_unknown_ones(server, caplog):
    """vLLM's `return_token_strs` (the vocabulary's strings) and `tools` (shown to the chat template, as the chat
    route does: the count is the chat's prompt_tokens, though this template shows none); unknown fields are logged and accepted as on the
    generation routes; a vLLM extra this server does not implement is a 400 naming it."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "Weather?"}]
    with server.client() as c:
        body = c.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
        assert body["token_strs"] == server.state.tokenizer.hf.convert_ids_to_tokens(body["tokens"])
        assert c.post("/tokenize", json={"prompt": "hello world"}).json()["token_strs"] is None
        with_tools = c.post("/tokenize", json={"messages": messages, "tools": [weather]}).json()["count"]
        r = c.post("/tokenize", json={"prompt": "hi", "tools": [weather]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        with caplog.at_level("WARNING"):
            assert c.post("/tokenize", json={"prompt": "hi", "not_a_field": 1}).status_code == 200
            assert c.post("/detokenize", json={"tokens": [5], "not_a_field": 1}).status_code == 200
        assert sum("not_a_field" in record.getMessage() for record in caplog.records) == 2
        r = c.post("/tokenize", json={"messages": messages, "documents": [{"text": "a"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
        assert r.json()["error"]["param"] == "documents"
        # a request's own template: rendered only under --trust-request-chat-template
        r = c.post("/tokenize", json={"messages": messages, "chat_template": "{{ messages }}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
    out = sdk(server).chat.completions.create(model="tiny", messages=messages, tools=[weather], max_tokens=1)
    assert out.usage.prompt_tokens == with_tools


def test_openapi_declares_error_responses(server):
    with server.client() as c:
        schema = c.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "429", "500", "503"} <= set(responses), path
        for status in ("400", "401", "404", "429", "500", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse")
    error = schema["components"]["schemas"]["ErrorInfo"]
    assert {"message", "type", "param", "code"} <= set(error["properties"])


def test_openapi_does_not_declare_422(server):
    with server.client() as c:
        schema = c.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "422" not in schema["paths"][path]["post"]["responses"], path


def test_streamed_usage_reports_cached_prompt_tokens_like_the_response(server):
    prompt = "A prompt long enough to fill a few KV blocks of the prefix cache, said twice."
    stream_raw(server, prompt=prompt, max_tokens=2, temperature=0)  # its blocks are now cached
    streamed = stream_raw(server, prompt=prompt, max_tokens=2, temperature=0, stream_options={"include_usage": True})[
        -1
    ]["usage"]
    with server.client() as c:
        whole = c.post(
            "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        ).json()["usage"]
    assert streamed["prompt_tokens_details"]["cached_tokens"] > 0
    assert streamed == whole


def test_an_fp8_kv_cache_serves_streams_and_ends_empty(tiny_model_dir):
    """`--kv-cache-dtype fp8` on CPU, served: a streamed completion over a prompt longer than a block (the
    decode steps read e4m3 K/V through the native kernels), its text the non-streamed one's, and every KV
    block free after."""
    from server.config.server_config import ServerConfig
    from tests.server.conftest import start_server

    uv, thread, running = start_server(
        tiny_model_dir, ServerConfig(served_model_name="tiny"), dtype="bfloat16", kv_cache_dtype="fp8"
    )
    try:
        assert running.engine.kv_cache_dtype == "fp8"
        body = {"model": "tiny", "prompt": OTHER_PROMPT * 8, "max_tokens": 12, "temperature": 0}
        streamed = "".join(chunk.choices[0].text for chunk in sdk(running).completions.create(**body, stream=True))
        assert streamed == complete(running, **body)["choices"][0]["text"] and streamed
        manager = running.engine.engine.scheduler.kv_cache_manager
        assert manager.usage == 0 and manager.block_pool.num_free_blocks == manager.block_pool.num_blocks
    finally:
        uv.should_exit = True
        thread.join(timeout=30)


def test_allowed_token_ids_and_bad_words_as_vllm_takes_them(server):
    """vLLM's extras through the SDK's extra_body, on completions and chat: allowed_token_ids keeps the output to
    those tokens; bad_words masks a word's tokens (here "_", forced by logit_bias, so the next best is written)."""
    client = sdk(server)
    (underscore,) = token_ids(server, "_")
    (dash,) = token_ids(server, "-")
    forced = {str(underscore): 100}
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logit_bias=forced, logprobs=0
    )
    assert out.choices[0].text == "____"
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logit_bias=forced, extra_body={"bad_words": ["_"]}
    )
    assert "_" not in out.choices[0].text and out.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        temperature=0,
        extra_body={"allowed_token_ids": [dash], "ignore_eos": True},
    )
    assert chat.choices[0].message.content == "----"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_token_masks_refused_name_their_field(server, extra, param):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_cache_salt_separates_prefix_cache_hits(server):
    """vLLM's cache_salt: a repeated prompt under another salt gets no cached tokens, under the same salt it does;
    a salt that is not a non-empty string is a 400 naming it."""
    client = sdk(server)
    prompt = "cache salt test: " + "lorem ipsum dolor sit amet " * 12

    def cached(salt):
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": salt}
        )
        details = out.usage.prompt_tokens_details
        return 0 if details is None else details.cached_tokens

    assert cached("salt-one") == 0
    assert cached("salt-two") == 0
    assert cached("salt-one") > 0
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_return_tokens_as_token_ids(server):
    """vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>" (the ids of the output's tokens, as
    /tokenize gives them), on completions (offsets over those strings) and chat (their bytes too), streamed or not."""
    client = sdk(server)
    extra = {"return_tokens_as_token_ids": True}
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, extra_body=extra
    )
    ids = token_ids(server, plain.choices[0].text)
    lp = out.choices[0].logprobs
    assert lp.tokens == [f"token_id:{i}" for i in ids]
    assert lp.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert all(top[token] == value for top, token, value in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    assert all(key.startswith("token_id:") for top in lp.top_logprobs for key in top)
    streamed = [
        t
        for chunk in client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, stream=True, extra_body=extra
        )
        for t in (chunk.choices[0].logprobs.tokens if chunk.choices and chunk.choices[0].logprobs else [])
    ]
    assert streamed == lp.tokens
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{i}" for i in token_ids(server, chat.choices[0].message.content)]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
