"""vLLM's `truncate_prompt_tokens` on /v1/completions and /v1/chat/completions: each prompt keeps its last n tokens
(-1: the context length), so a prompt longer than the context is served instead of refused. It was refused as
unsupported."""

from __future__ import annotations

import openai
import pytest

PROMPT = "The quick brown fox jumps over the lazy dog and keeps on running"


def test_completions_keep_the_prompts_last_tokens(server):
    client = server.sdk()
    ids = server.state.tokenizer.encode(PROMPT)
    assert len(ids) > 4
    truncated = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=0,
        extra_body={"truncate_prompt_tokens": 4},
    )
    assert truncated.usage.prompt_tokens == 4
    tail = client.completions.create(model="tiny", prompt=ids[-4:], max_tokens=3, temperature=0, echo=True, logprobs=0)
    assert truncated.choices[0].text == tail.choices[0].text
    assert truncated.choices[0].logprobs.tokens == tail.choices[0].logprobs.tokens
    several = client.completions.create(
        model="tiny", prompt=[ids, ids[:2]], max_tokens=1, extra_body={"truncate_prompt_tokens": 3}
    )
    assert several.usage.prompt_tokens == 3 + 2


def test_a_prompt_longer_than_the_context_is_truncated_to_fit(server):
    client = server.sdk()
    limit = server.state.max_model_len
    too_long = [5] * (limit + 10)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=too_long, max_tokens=2)
    reply = client.completions.create(
        model="tiny", prompt=too_long, max_tokens=2, extra_body={"truncate_prompt_tokens": limit - 2}
    )
    assert reply.usage.prompt_tokens == limit - 2 and reply.usage.completion_tokens <= 2
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "fox " * limit}],
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": limit - 1},
    )
    assert chat.usage.prompt_tokens == limit - 1


def test_chat_keeps_the_rendered_prompts_last_tokens(server):
    client = server.sdk()
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage.prompt_tokens
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=1, extra_body={"truncate_prompt_tokens": 5}
    )
    assert whole > 5 and reply.usage.prompt_tokens == 5


def test_minus_one_is_the_context_length(server):
    client = server.sdk()
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"truncate_prompt_tokens": -1}
    )
    assert reply.usage.prompt_tokens == len(server.state.tokenizer.encode(PROMPT))


@pytest.mark.parametrize("value", [0, -2, 10**6])
def test_a_value_that_leaves_no_prompt_or_exceeds_the_context_is_a_400(server, value):
    client = server.sdk()
    for create in (
        lambda: client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"truncate_prompt_tokens": value}
        ),
        lambda: client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=1,
            extra_body={"truncate_prompt_tokens": value},
        ),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            create()
        assert caught.value.body["param"] == "truncate_prompt_tokens"


def test_truncation_side_right_keeps_the_first_tokens(server):
    """vLLM's truncation_side: "right" keeps a prompt's first n tokens; without truncate_prompt_tokens it is a 400
    naming it (it would do nothing)."""
    client = server.sdk()
    ids = server.state.tokenizer.encode(PROMPT)
    head = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 4, "truncation_side": "right"},
    )
    plain = client.completions.create(model="tiny", prompt=ids[:4], max_tokens=3, temperature=0)
    assert head.usage.prompt_tokens == 4 and head.choices[0].text == plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"truncation_side": "left"})
    assert info.value.body["param"] == "truncation_side"
