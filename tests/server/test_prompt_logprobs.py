"""vLLM's `prompt_logprobs` on /v1/completions (per choice) and /v1/chat/completions (on the response): per prompt
position the prompt's token with its logprob and rank, then the best alternatives, keyed by token id; the first
position None. It was refused as unsupported."""

from __future__ import annotations

import math

import openai
import pytest

PROMPT = "The quick brown fox jumps over the lazy dog"


def _check_positions(positions, token_ids, num_top):
    assert positions[0] is None and len(positions) == len(token_ids)
    for position, token_id in zip(positions[1:], token_ids[1:]):
        own = position[str(token_id)]
        assert own["logprob"] <= 0 and own["rank"] >= 1
        alternatives = [entry for key, entry in position.items() if key != str(token_id)]
        assert len(position) in (num_top, num_top + 1)
        if num_top:  # the best alternative is the best of all
            best = max(entry["logprob"] for entry in position.values())
            assert (own["rank"] == 1) == math.isclose(own["logprob"], best, abs_tol=1e-6)
        for entry in alternatives:
            assert 1 <= entry["rank"] <= num_top and entry["decoded_token"] is not None


def test_completions_give_each_choice_its_prompts_logprobs(server):
    ids = server.state.tokenizer.encode(PROMPT)
    with server.client() as c:
        reply = c.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 2, "temperature": 0, "prompt_logprobs": 2}
        ).json()
        echoed = c.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
        ).json()
    for choice in reply["choices"]:
        _check_positions(choice["prompt_logprobs"], ids, 2)
    # the same values as an echo's logprobs of the prompt
    scored = [position[str(t)]["logprob"] for position, t in zip(reply["choices"][0]["prompt_logprobs"][1:], ids[1:])]
    assert scored == pytest.approx(echoed["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)], abs=1e-5)
    assert echoed["choices"][0]["prompt_logprobs"] is None


def test_completions_prompt_logprobs_beside_an_echo_with_more_logprobs(server):
    ids = server.state.tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 3, "temperature": 0}
    with server.client() as c:
        reply = c.post("/v1/completions", json={**body, "prompt_logprobs": 0}).json()
        alone = c.post("/v1/completions", json=body).json()
    choice = reply["choices"][0]
    _check_positions(choice["prompt_logprobs"], ids, 0)
    assert choice["logprobs"] == alone["choices"][0]["logprobs"]  # the echo's alternatives are not cut to 0


def test_chat_gives_the_rendered_prompts_logprobs(server):
    client = server.sdk()
    messages = [{"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    positions = reply.model_extra["prompt_logprobs"]
    with server.client() as c:
        ids = c.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert reply.usage.prompt_tokens == len(ids)
    _check_positions(positions, ids, 1)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streamed_too_many_or_negative_prompt_logprobs_are_a_400(server, route):
    client = server.sdk()

    def create(**extra):
        if route == "completions":
            return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, **extra)
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=1, **extra
        )

    for extra in (
        {"stream": True, "extra_body": {"prompt_logprobs": 1}},
        {"extra_body": {"prompt_logprobs": 10**6}},
        {"extra_body": {"prompt_logprobs": -1}},
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            create(**extra)
        assert caught.value.body["param"] == "prompt_logprobs", extra
