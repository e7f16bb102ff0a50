"""Which content shape a chat template reads, told from its syntax tree (vLLM's --chat-template-content-format auto):
text, or OpenAI's list of parts when the template loops over a message's content."""

from __future__ import annotations

import pytest

from engine.text.chat_content_format import detect_content_format, names_developer_role

STRING_TEMPLATES = {
    "printed": "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}",
    "attribute": "{% for m in messages %}{{ m.content | trim }}{% endfor %}",
    # a loop over something else's content is not a message's
    "other loop": "{% for doc in documents %}{% for c in doc.content %}{{ c }}{% endfor %}{% endfor %}",
    "not jinja": "{% for message in messages %}{{ message.content }",
}
OPENAI_TEMPLATES = {
    "item": "{% for message in messages %}{% for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}",
    "attribute": "{% for m in messages %}{% for part in m.content %}{{ part['text'] }}{% endfor %}{% endfor %}",
    # Llama 3.2's and Gemma 3's shape: text printed, parts looped over
    "either": (
        "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}{{ part.text }}"
        "{% endfor %}{% endif %}{% endfor %}"
    ),
    # messages reached through variables set from it
    "aliased": (
        "{% set loop_messages = messages[1:] %}{% set rest = loop_messages %}"
        "{% for message in rest %}{% for part in message.content %}{{ part.text }}{% endfor %}{% endfor %}"
    ),
    "content variable": (
        "{% for message in messages %}{% set content = message.content %}"
        "{% for part in content %}{{ part.text }}{% endfor %}{% endfor %}"
    ),
}


@pytest.mark.parametrize("template", STRING_TEMPLATES.values(), ids=STRING_TEMPLATES.keys())
def test_a_template_that_prints_the_content_reads_text(template):
    assert detect_content_format(template) == "string"


@pytest.mark.parametrize("template", OPENAI_TEMPLATES.values(), ids=OPENAI_TEMPLATES.keys())
def test_a_template_that_loops_over_the_content_reads_parts(template):
    assert detect_content_format(template) == "openai"


def test_the_developer_role_is_kept_for_templates_that_name_it():
    assert names_developer_role("{% if message.role == 'developer' %}# Instructions{% endif %}")
    assert names_developer_role('{% if m["role"] == "developer" %}{% endif %}')
    assert not names_developer_role("{% for message in messages %}{{ message.role }}{% endfor %}")
