"""A chat template checked to parse, as transformers renders it: the config's check of an inline --chat-template
(at start-up, naming the flag) and the tokenizer's of a file's text share it."""

from __future__ import annotations


def check_chat_template(text: str, where: str) -> None:
    """ValueError naming `where` and the line when `text` is not a Jinja template."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # the environment transformers renders chat templates in
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"{where} is not valid Jinja (line {exc.lineno}: {exc.message})") from None
