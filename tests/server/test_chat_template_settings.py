"""vLLM's chat template flags: --chat-template-content-format (text or OpenAI's parts, auto read from the
template), --default-chat-template-kwargs, --trust-request-chat-template (a request's own chat_template),
--response-role; and the developer role kept for a template that knows it."""

from __future__ import annotations

import openai
import pytest

from server.config.server_config import ServerConfig
from server.config.settings import SettingsError, load_settings
from tests.server.conftest import prompt_text, serving

# loops over a message's content when it is a list (as Llama 3.2's does); knows the developer role and a variable
PARTS_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'developer' %}{{ 'DEV:' }}{% else %}{{ message['role'] + ':' }}{% endif %}"
    "{% if message['content'] is string %}{{ 'text=' + message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ '[' + part['text'] + ']' }}{% endfor %}{% endif %}"
    "{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ 'no thinking' }}{% endif %}{% endif %}"
)
REQUEST_TEMPLATE = "{% for message in messages %}<<{{ message['content'] }}>>{% endfor %}"
CONVERSATION = [
    {"role": "developer", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "hello"},
]


@pytest.fixture(scope="module")
def trusting_server(tiny_model_dir):
    config = ServerConfig(
        served_model_name="tiny",
        trust_request_chat_template=True,
        default_chat_template_kwargs={"enable_thinking": False},
        response_role="model",
    )
    with serving(tiny_model_dir, config, chat_template=PARTS_TEMPLATE) as running:
        yield running


@pytest.fixture(scope="module")
def text_server(tiny_model_dir):
    config = ServerConfig(served_model_name="tiny", chat_template_content_format="string")
    with serving(tiny_model_dir, config, chat_template=PARTS_TEMPLATE) as running:
        yield running


def test_a_template_that_loops_over_content_gets_parts(trusting_server):
    # auto: the template loops over content, so every message's content comes as parts (a string as one part),
    # and a template that names the developer role keeps it
    text = prompt_text(trusting_server, messages=CONVERSATION)
    assert text == "DEV:[be brief]\nuser:[a][b]\nassistant:[ok]\nuser:[hello]\nassistant:no thinking"


def test_the_string_format_joins_the_parts(text_server):
    text = prompt_text(text_server, messages=CONVERSATION)
    assert text == "DEV:text=be brief\nuser:text=a\nb\nassistant:text=ok\nuser:text=hello\nassistant:"


def test_default_template_kwargs_yield_to_the_requests(trusting_server):
    text = prompt_text(trusting_server, messages=CONVERSATION[-1:], chat_template_kwargs={"enable_thinking": True})
    assert text.endswith("assistant:")
    client = trusting_server.sdk()
    default = client.chat.completions.create(model="tiny", messages=CONVERSATION[-1:], max_tokens=1)
    thinking = client.chat.completions.create(
        model="tiny",
        messages=CONVERSATION[-1:],
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert default.usage.prompt_tokens > thinking.usage.prompt_tokens


def test_a_trusted_requests_template_is_rendered(trusting_server):
    text = prompt_text(trusting_server, messages=CONVERSATION[-1:], chat_template=REQUEST_TEMPLATE)
    assert text == "<<hello>>"
    reply = trusting_server.sdk().chat.completions.create(
        model="tiny", messages=CONVERSATION[-1:], max_tokens=1, extra_body={"chat_template": REQUEST_TEMPLATE}
    )
    assert reply.usage.prompt_tokens == len(trusting_server.state.tokenizer.encode("<<hello>>", False))
    with pytest.raises(openai.BadRequestError) as caught:
        trusting_server.sdk().chat.completions.create(
            model="tiny", messages=CONVERSATION[-1:], max_tokens=1, extra_body={"chat_template": "{% for %}"}
        )
    assert caught.value.body["param"] == "chat_template" and "not valid Jinja" in caught.value.body["message"]


def test_an_untrusted_requests_template_is_a_400(text_server):
    with pytest.raises(openai.BadRequestError) as caught:
        text_server.sdk().chat.completions.create(
            model="tiny", messages=CONVERSATION[-1:], max_tokens=1, extra_body={"chat_template": REQUEST_TEMPLATE}
        )
    assert caught.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in caught.value.body["message"]
    with text_server.client() as c:
        reply = c.post("/tokenize", json={"messages": CONVERSATION[-1:], "chat_template": REQUEST_TEMPLATE})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "chat_template"


def test_the_answers_role(trusting_server, text_server):
    client = trusting_server.sdk()
    reply = client.chat.completions.create(model="tiny", messages=CONVERSATION[-1:], max_tokens=2)
    assert reply.choices[0].message.role == "model"
    stream = client.chat.completions.create(model="tiny", messages=CONVERSATION[-1:], max_tokens=2, stream=True)
    assert [chunk.choices[0].delta.role for chunk in stream if chunk.choices][0] == "model"
    # no new turn: the answer continues the last message, in its role (as vLLM answers)
    reply = text_server.sdk().chat.completions.create(
        model="tiny", messages=CONVERSATION[-1:], max_tokens=2, extra_body={"add_generation_prompt": False}
    )
    assert reply.choices[0].message.role == "user"
    assert (
        text_server.sdk()
        .chat.completions.create(model="tiny", messages=CONVERSATION[-1:], max_tokens=2)
        .choices[0]
        .message.role
        == "assistant"
    )


@pytest.mark.parametrize("key", ["messages", "tools", "chat_template"])
def test_default_template_kwargs_cannot_set_the_renderers_arguments(key):
    with pytest.raises(SettingsError, match="--default-chat-template-kwargs"):
        load_settings(["--default-chat-template-kwargs", f'{{"{key}": 1}}'], {})


@pytest.mark.parametrize(
    "template",
    [
        "{{ 1 / 0 }}",
        "{{ 'a' + 1 }}",
        "{{ '{}'.format() }}",
        "{% macro deeper() %}{{ deeper() }}{% endmacro %}{{ deeper() }}",
    ],
)
def test_a_trusted_template_that_fails_while_rendering_is_a_400(trusting_server, template):
    # a runtime error in the request's own template is the request's fault (as vLLM answers it), not a 500
    with pytest.raises(openai.BadRequestError) as caught:
        trusting_server.sdk().chat.completions.create(
            model="tiny", messages=CONVERSATION[-1:], max_tokens=1, extra_body={"chat_template": template}
        )
    assert "the chat template failed" in caught.value.body["message"]
    with trusting_server.client() as c:
        reply = c.post("/tokenize", json={"messages": CONVERSATION[-1:], "chat_template": template})
    assert reply.status_code == 400, reply.text
