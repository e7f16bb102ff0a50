"""--reasoning-parser (server/openai/reasoning.py), as vLLM's: a reasoning model's thinking in chat's `reasoning`,
apart from its answer, streamed as it is written; the non-streamed split and the joined stream agree, however the
text arrives."""

from __future__ import annotations

import random

import pytest

from server.config.server_config import ServerConfig
from server.openai.reasoning import ReasoningSplitter, starts_in_reasoning
from tests.server.conftest import serving

CASES = [
    # (text, starts in reasoning, reasoning, content)
    ("<think>Let me see.</think>The answer is 4.", False, "Let me see.", "The answer is 4."),
    ("\n<think>a</think>\n\nb", False, "a", "\n\nb"),
    ("Plain answer, no thinking.", False, None, "Plain answer, no thinking."),
    ("a < b <thin", False, None, "a < b <thin"),
    ("<think>cut off while thinking", False, "cut off while thinking", None),
    ("thinking from the prompt's <think></think>answer", True, "thinking from the prompt's <think>", "answer"),
    ("<think>written again</think>x", True, "written again", "x"),
    ("only thought</thi", True, "only thought</thi", None),
    ("</think>", True, None, None),
]


@pytest.mark.parametrize("text, inside, reasoning, content", CASES)
@pytest.mark.parametrize("split", ["whole", "characters", "random"])
def test_the_split_is_the_same_however_the_text_arrives(text, inside, reasoning, content, split):
    assert ReasoningSplitter(inside).split(text) == (reasoning, content)
    cuts = {"whole": [], "characters": list(range(1, len(text))), "random": None}[split]
    if cuts is None:
        cuts = sorted(random.Random(len(text)).sample(range(1, len(text)), min(5, len(text) - 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    splitter, thought, answer = ReasoningSplitter(inside), "", ""
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, i == len(pieces) - 1)
        thought, answer = thought + r, answer + c
    assert (thought or None, answer or None) == (reasoning, content)


def test_where_the_output_starts():
    assert starts_in_reasoning("deepseek_r1", "Hi<|Assistant|>")
    assert starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n")


THINKING = r"<think>Two and two\. </think>Four\."


def test_chat_returns_the_thinking_apart_streamed_or_not(tiny_model_dir):
    """A forced thinking output (guided_regex) under --reasoning-parser qwen3: the message's `reasoning` and
    `content` are the two parts, the stream sends the thinking as `reasoning` deltas before the answer's, and
    without the parser nothing changes (no `reasoning` key at all)."""
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "2+2?"}],
        max_tokens=40,
        temperature=0,
        extra_body={"guided_regex": THINKING},
    )
    with serving(tiny_model_dir, ServerConfig(served_model_name="tiny", reasoning_parser="qwen3")) as server:
        client = server.sdk()
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert (message.reasoning, message.content) == ("Two and two. ", "Four.")
        order, thought, answer = [], "", ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta
            piece = getattr(delta, "reasoning", None)
            if piece:
                thought += piece
                order.append("reasoning")
            if delta.content:
                answer += delta.content
                order.append("content")
        assert (thought, answer) == ("Two and two. ", "Four.")
        assert order == sorted(order, key=lambda kind: kind == "content") and order.count("reasoning") > 1
    with serving(tiny_model_dir, ServerConfig(served_model_name="tiny")) as server:
        with server.client() as http:
            body = {**kwargs, **kwargs["extra_body"]}
            del body["extra_body"]
            message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["content"] == "<think>Two and two. </think>Four." and "reasoning" not in message
