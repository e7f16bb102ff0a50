"""vLLM's `echo` on /v1/chat/completions: when the last message is the assistant's (a prefilled answer, with
continue_final_message), the answer starts with its text, streamed as the first content after the role; otherwise
nothing is added. It was refused as unsupported."""

from __future__ import annotations

import json

PREFILL = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "General Kenobi"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def _streamed(server, body) -> dict[int, str]:
    texts: dict[int, str] = {}
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    return texts


def test_echo_starts_the_answer_with_the_assistants_last_message(server):
    client = server.sdk()
    plain = client.chat.completions.create(
        model="tiny", messages=PREFILL, max_tokens=4, temperature=0, n=2, extra_body=CONTINUE
    )
    echoed = client.chat.completions.create(
        model="tiny", messages=PREFILL, max_tokens=4, temperature=0, n=2, extra_body={**CONTINUE, "echo": True}
    )
    for a, b in zip(plain.choices, echoed.choices):
        assert b.message.content == "General Kenobi" + a.message.content
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (
        plain.usage.prompt_tokens,
        plain.usage.completion_tokens,
    )
    body = {"model": "tiny", "messages": PREFILL, "max_tokens": 4, "temperature": 0, "n": 2, **CONTINUE, "echo": True}
    assert _streamed(server, body) == {c.index: c.message.content for c in echoed.choices}


def test_echo_adds_nothing_after_a_users_message(server):
    client = server.sdk()
    question = PREFILL[:1]
    plain = client.chat.completions.create(model="tiny", messages=question, max_tokens=4, temperature=0)
    echoed = client.chat.completions.create(
        model="tiny", messages=question, max_tokens=4, temperature=0, extra_body={"echo": True}
    )
    assert echoed.choices[0].message.content == plain.choices[0].message.content
