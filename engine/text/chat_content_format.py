"""Which shape of message content a chat template reads: text ("string") or OpenAI's list of parts ("openai").

A template that loops over a message's content (`{% for part in message['content'] %}`, Llama 3.2's and Gemma 3's
do) expects parts: given text, it would loop over the characters. One that prints the content expects text. Told
from the template's syntax tree, as vLLM's `--chat-template-content-format auto` tells it: the loops over
`messages` (or over a variable set from it, `loop_messages = messages[1:]`) name the message variables, and a loop
over one of those's `content` (or over a variable named `content`) means parts.
"""

from __future__ import annotations

from typing import Iterable, Literal, Optional

ContentFormat = Literal["string", "openai"]


def detect_content_format(template: str) -> ContentFormat:
    """ "openai" when `template` loops over a message's content, else "string" (also for one that does not parse:
    rendering it reports that)."""
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # the environment transformers renders chat templates in
        tree = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError:
        return "string"
    message_lists = _names_set_from(tree, "messages")
    loops = list(tree.find_all(nodes.For))
    messages = {
        loop.target.name for loop in loops if isinstance(loop.target, nodes.Name) and _reads(loop.iter, message_lists)
    }
    for loop in loops:
        over_content = isinstance(loop.iter, nodes.Name) and loop.iter.name == "content"
        if over_content or _reads(loop.iter, messages, key="content"):
            return "openai"
    return "string"


def names_developer_role(template: str) -> bool:
    """Whether the template knows the `developer` role by name (GPT-OSS's does): its messages keep that role,
    which other templates would not recognise (they get `system`)."""
    return '"developer"' in template or "'developer'" in template


def _names_set_from(tree, root: str) -> set[str]:
    """`root` and every variable assigned from it, or from one of those (`{% set loop_messages = messages[1:] %}`)."""
    from jinja2 import nodes

    names = {root}
    assigns = list(tree.find_all(nodes.Assign))
    grew = True
    while grew:
        grew = False
        for assign in assigns:
            if isinstance(assign.target, nodes.Name) and assign.target.name not in names and _reads(assign.node, names):
                names.add(assign.target.name)
                grew = True
    return names


def _reads(node, names: Iterable[str], key: Optional[str] = None) -> bool:
    """Whether `node` is one of `names` (with `key`: its item or attribute `key`), seen through filters, tests and
    slices (`messages | selectattr(...)`, `message.content is string`, `messages[1:]`)."""
    from jinja2 import nodes

    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, nodes.Getitem):
        named = isinstance(node.arg, nodes.Const) and node.arg.value == key
    elif isinstance(node, nodes.Getattr):
        named = node.attr == key
    else:
        return False
    return named and _reads(node.node, names)
