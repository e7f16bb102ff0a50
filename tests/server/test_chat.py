"""POST /v1/chat/completions over a real server: the openai SDK (sync, async, streaming) and raw httpx."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.server.sse_frames import stream_raw as stream_frames

USER = [{"role": "user", "content": "Hello, how are you today?"}]


# ------------------------------------------------------------------ helpers


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(server, **body) -> dict:
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def greedy_content(server, messages=USER, max_tokens: int = 10) -> str:
    return chat(server, messages=messages, max_tokens=max_tokens, temperature=0)["choices"][0]["message"]["content"]


def prompt_tokens(server, messages, **extra) -> list[int]:
    with server.client() as c:
        r = c.post("/tokenize", json={"model": "tiny", "messages": messages, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"])
    return body["tokens"]


def stream_raw(server, **body) -> list[dict]:
    return stream_frames(server, "/v1/chat/completions", **body)


# ------------------------------------------------------------------ the SDK


def test_sdk_sync(server):
    n_prompt = len(prompt_tokens(server, USER))
    out = sdk(server).chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == "tiny"
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str) and choice.message.content
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n_prompt, 8, n_prompt + 8)
    assert choice.message.content == greedy_content(server, USER, 8)


def test_sdk_async(server):
    conversations = [USER, [{"role": "user", "content": "Tell me about the weather."}]]
    expected = [greedy_content(server, m, 6) for m in conversations]

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60
        ) as client:
            outs = await asyncio.gather(
                *(
                    client.chat.completions.create(model="tiny", messages=m, max_tokens=6, temperature=0)
                    for m in conversations
                )
            )
            stream = await client.chat.completions.create(
                model="tiny", messages=USER, max_tokens=6, temperature=0, stream=True
            )
            pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        return [o.choices[0].message.content for o in outs], "".join(pieces)

    contents, streamed = asyncio.run(main())
    assert contents == expected
    assert streamed == expected[0]


def test_sdk_streaming(server):
    expected = greedy_content(server, USER, 10)
    chunks = list(
        sdk(server).chat.completions.create(model="tiny", messages=USER, max_tokens=10, temperature=0, stream=True)
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


# ------------------------------------------------------------------ messages


def test_content_as_text_parts(server):
    as_string = chat(server, messages=USER, max_tokens=6, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": USER[0]["content"]}]}]
    as_parts = chat(server, messages=parts, max_tokens=6, temperature=0)
    assert as_parts["choices"][0]["message"]["content"] == as_string["choices"][0]["message"]["content"]
    assert as_parts["usage"]["prompt_tokens"] == as_string["usage"]["prompt_tokens"]

    two_parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    joined = [{"role": "user", "content": "first\nsecond"}]
    assert prompt_tokens(server, two_parts) == prompt_tokens(server, joined)
    assert greedy_content(server, two_parts, 5) == greedy_content(server, joined, 5)


def test_roles(server):
    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "How is the weather?"},
    ]
    out = chat(server, messages=conversation, max_tokens=4, temperature=0)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == len(prompt_tokens(server, conversation))

    # developer is the newer name of system: the same prompt, the same answer
    developer = [{"role": "developer", "content": "You are terse."}, *conversation[1:]]
    assert prompt_tokens(server, developer) == prompt_tokens(server, conversation)
    assert greedy_content(server, developer, 4) == out["choices"][0]["message"]["content"]

    # the ChatML template puts every role's text in the prompt
    with server.client() as c:
        text = c.post("/detokenize", json={"tokens": prompt_tokens(server, conversation)}).json()["prompt"]
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\nHi.<|im_end|>\n<|im_start|>user\nHow is the weather?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tokenize_messages_matches_usage(server):
    with_prompt = prompt_tokens(server, USER)
    without = prompt_tokens(server, USER, add_generation_prompt=False)
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)
    out = chat(server, messages=USER, max_tokens=1, temperature=0)
    assert out["usage"]["prompt_tokens"] == len(with_prompt)


# ------------------------------------------------------------------ max tokens


def test_max_tokens_and_max_completion_tokens(server):
    for field in ("max_tokens", "max_completion_tokens"):
        out = chat(server, messages=USER, temperature=0, ignore_eos=True, **{field: 3})
        assert out["usage"]["completion_tokens"] == 3 and out["choices"][0]["finish_reason"] == "length", field
    out = chat(server, messages=USER, temperature=0, ignore_eos=True, max_tokens=7, max_completion_tokens=2)
    assert out["usage"]["completion_tokens"] == 2  # max_completion_tokens wins, as OpenAI documents
    via_sdk = sdk(server).chat.completions.create(model="tiny", messages=USER, temperature=0, max_completion_tokens=4)
    assert via_sdk.usage.completion_tokens == 4


# ------------------------------------------------------------------ logprobs


def test_logprobs_and_top_logprobs(server):
    out = sdk(server).chat.completions.create(
        model="tiny", messages=USER, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = out.choices[0]
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and (entry.bytes == list(entry.token.encode("utf-8")) or entry.token == "\ufffd")
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert entry.top_logprobs[0].token == entry.token
        # a token's text's UTF-8, or its own bytes where it holds part of a character (its text U+FFFD)
        assert all(t.bytes == list(t.token.encode("utf-8")) for t in entry.top_logprobs if "\ufffd" not in t.token)
    if "\ufffd" not in choice.message.content:
        assert "".join(e.token for e in content) == choice.message.content
    # the tokens' bytes join into the text, characters cut between tokens included (OpenAI's `bytes`)
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == choice.message.content

    only_chosen = chat(server, messages=USER, max_tokens=3, temperature=0, logprobs=True)
    entries = only_chosen["choices"][0]["logprobs"]["content"]
    assert len(entries) == 3 and all(e["top_logprobs"] == [] for e in entries)
    assert [e["token"] for e in entries] == [e.token for e in content[:3]]

    assert chat(server, messages=USER, max_tokens=2, temperature=0)["choices"][0]["logprobs"] is None


def test_streamed_logprobs_match(server):
    expected = chat(server, messages=USER, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    chunks = stream_raw(server, messages=USER, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    entries = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    want = expected["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [e["token"] for e in want]
    assert [e["logprob"] for e in entries] == pytest.approx([e["logprob"] for e in want], abs=1e-5)


# ------------------------------------------------------------------ n > 1


def test_n_streams_interleave_by_index(server):
    expected = greedy_content(server, USER, 6)
    chunks = stream_raw(server, messages=USER, n=2, max_tokens=6, temperature=0)
    assert len({c["id"] for c in chunks}) == 1
    order = [c["choices"][0]["index"] for c in chunks]
    first_role = {}
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        index = choice["index"]
        if choice["delta"].get("role") is not None:
            assert choice["delta"]["role"] == "assistant" and index not in first_role
            first_role[index] = True
        else:
            assert index in first_role  # the role comes first for each choice
        texts[index] += choice["delta"].get("content") or ""
        if choice["finish_reason"] is not None:
            finish[index] = choice["finish_reason"]
    assert texts == {0: expected, 1: expected}
    assert finish == {0: "length", 1: "length"}
    # interleaved, not one choice after the other
    last_zero = max(i for i, index in enumerate(order) if index == 0)
    first_one_content = next(
        i
        for i, c in enumerate(chunks)
        if c["choices"][0]["index"] == 1 and c["choices"][0]["delta"].get("role") is None
    )
    assert first_one_content < last_zero


def test_n_with_seed(server):
    body = {"messages": USER, "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    out = chat(server, **body)
    contents = [c["message"]["content"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert contents[0] != contents[1]
    assert [c["message"]["content"] for c in chat(server, **body)["choices"]] == contents
    assert out["usage"]["completion_tokens"] == 16


# ------------------------------------------------------------------ stop, seed, usage, response_format


def test_stop(server):
    full = greedy_content(server, USER, 20)
    k, stop = next(
        (
            (k, full[k : k + 2])
            for k in range(1, len(full) - 1)
            if full[: k + 2].isascii()
            and full[: k + 2].isprintable()
            and not full[k : k + 2].isspace()
            and full.find(full[k : k + 2]) == k
        ),
        (None, None),
    )
    assert stop is not None, f"no usable stop string in {full!r}"
    for value in (stop, ["\u2603 never", stop]):
        choice = chat(server, messages=USER, max_tokens=20, temperature=0, stop=value)["choices"][0]
        assert choice["message"]["content"] == full[:k] and choice["finish_reason"] == "stop"
    chunks = stream_raw(server, messages=USER, max_tokens=20, temperature=0, stop=stop)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == full[:k]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_seed(server):
    client = sdk(server)

    def sample(seed):
        return (
            client.chat.completions.create(
                model="tiny", messages=USER, max_tokens=8, temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .message.content
        )

    first = sample(5)
    assert sample(5) == first
    assert sample(6) != first


def test_include_usage(server):
    n_prompt = len(prompt_tokens(server, USER))
    chunks = list(
        sdk(server).chat.completions.create(
            model="tiny",
            messages=USER,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, last = chunks
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        n_prompt,
        4,
        n_prompt + 4,
    )
    assert all(c.usage is None for c in content)

    chunks = stream_raw(server, messages=USER, n=2, max_tokens=3, temperature=0, stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_stream_options_without_obfuscation_are_taken(server, route):
    """OpenAI's stream_options.include_obfuscation: false (no padding on the chunks, which this server never
    adds), as the SDK types it. It was a 400 ("Extra inputs are not permitted") on chat and completions while the
    Responses API took it; true, padding this server does not write, is refused by name."""
    client = sdk(server)
    create = client.chat.completions.create if route == "chat" else client.completions.create
    prompt = {"messages": USER} if route == "chat" else {"prompt": "Hello"}
    options = {"include_usage": True, "include_obfuscation": False}
    chunks = list(create(model="tiny", max_tokens=4, temperature=0, stream=True, stream_options=options, **prompt))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as refused:
        create(model="tiny", max_tokens=4, stream=True, stream_options={"include_obfuscation": True}, **prompt)
    error = refused.value.body
    assert (error["param"], error["code"]) == ("stream_options.include_obfuscation", "unsupported_parameter")


def test_response_format_text_accepted(server):
    out = sdk(server).chat.completions.create(
        model="tiny", messages=USER, max_tokens=3, temperature=0, response_format={"type": "text"}
    )
    assert out.choices[0].message.content == greedy_content(server, USER, 3)
