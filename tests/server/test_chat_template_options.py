"""What the chat template is given, on /v1/chat/completions and /tokenize: vLLM's `chat_template_kwargs` (more
variables for the template, e.g. Qwen3's `enable_thinking`) and `continue_final_message` (the last message left open,
so the model continues it: a prefilled answer), both once refused as unsupported; and each message's `name`."""

from __future__ import annotations

import openai
import pytest

from server.config.server_config import ServerConfig
from tests.server.conftest import prompt_text, serving

# ChatML with a variable of its own, as Qwen3's template reads `enable_thinking`
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] }}{% if message.name %}{{ ' ' + message.name }}{% endif %}"
    "{% if message.reasoning_content %}{{ ' <think>' + message.reasoning_content + '</think>' }}{% endif %}"
    "{{ '\n' + message['content'] }}"
    "{% if not (loop.last and continue_final_message is defined and continue_final_message) %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ 'no thinking\n' }}{% endif %}{% endif %}"
)
QUESTION = [{"role": "user", "content": "hello there"}]
PREFILL = [*QUESTION, {"role": "assistant", "content": "General Kenobi"}]


@pytest.fixture(scope="module")
def thinking_server(tiny_model_dir):
    with serving(tiny_model_dir, ServerConfig(served_model_name="tiny"), chat_template=THINKING_TEMPLATE) as running:
        yield running


def test_chat_template_kwargs_reach_the_template(thinking_server):
    client = thinking_server.sdk()

    def prompt_tokens(**extra) -> int:
        reply = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=1, extra_body=extra)
        return reply.usage.prompt_tokens

    default = prompt_tokens()
    without_thinking = prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert without_thinking > default == prompt_tokens(chat_template_kwargs={"enable_thinking": True})
    text = prompt_text(thinking_server, messages=QUESTION, chat_template_kwargs={"enable_thinking": False})
    assert text.endswith("<|im_start|>assistant\nno thinking\n")
    with thinking_server.client() as c:
        counted = c.post(
            "/tokenize", json={"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}}
        ).json()["count"]
    assert counted == without_thinking


@pytest.mark.parametrize("key", ["messages", "tools", "tokenize", "chat_template", "add_generation_prompt"])
def test_chat_template_kwargs_cannot_set_the_renderers_own_arguments(thinking_server, key):
    client = thinking_server.sdk()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=QUESTION, max_tokens=1, extra_body={"chat_template_kwargs": {key: True}}
        )
    assert caught.value.body["param"] == f"chat_template_kwargs.{key}"
    with thinking_server.client() as c:
        reply = c.post("/tokenize", json={"messages": QUESTION, "chat_template_kwargs": {key: True}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == f"chat_template_kwargs.{key}"


def test_continue_final_message_leaves_the_last_message_open(thinking_server):
    client = thinking_server.sdk()
    text = prompt_text(thinking_server, messages=PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nGeneral Kenobi")
    closed = prompt_text(thinking_server, messages=PREFILL, add_generation_prompt=False)
    assert closed.endswith("General Kenobi<|im_end|>\n")
    reply = client.chat.completions.create(
        model="tiny",
        messages=PREFILL,
        max_tokens=3,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    with thinking_server.client() as c:
        expected = c.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["count"]
    assert reply.usage.prompt_tokens == expected
    assert reply.choices[0].finish_reason == "length"


def test_continue_final_message_with_a_generation_prompt_is_a_400(thinking_server):
    client = thinking_server.sdk()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=PREFILL, max_tokens=1, extra_body={"continue_final_message": True}
        )
    assert caught.value.body["param"] == "continue_final_message"
    with thinking_server.client() as c:
        reply = c.post("/tokenize", json={"messages": PREFILL, "continue_final_message": True})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "continue_final_message"


def test_a_messages_name_reaches_the_template(thinking_server):
    """OpenAI's `name` of a participant: vLLM hands it to the template with the message; it was dropped."""
    named = [{"role": "user", "content": "hello there", "name": "obi_wan"}]
    assert prompt_text(thinking_server, messages=named).startswith("<|im_start|>user obi_wan\nhello there")
    client = thinking_server.sdk()
    plain = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=1).usage.prompt_tokens
    assert client.chat.completions.create(model="tiny", messages=named, max_tokens=1).usage.prompt_tokens > plain


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_an_earlier_turns_thinking_reaches_the_template(thinking_server, key):
    """An assistant turn's thinking, as --reasoning-parser returns it (vLLM's `reasoning`, or its older name),
    goes to the template as `reasoning_content` (Qwen3's templates read it) and `reasoning`."""
    turns = [*QUESTION, {"role": "assistant", "content": "General Kenobi", key: "mulling"}, *QUESTION]
    assert "<|im_start|>assistant <think>mulling</think>\nGeneral Kenobi" in prompt_text(
        thinking_server, messages=turns
    )
