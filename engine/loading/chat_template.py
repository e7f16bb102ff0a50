"""A chat template checked to parse, as transformers renders it: the config's check of an inline --chat-template
(at start-up, naming the flag) and the tokenizer's of a file's text share it."""

from __future__ import annotations

import os


def check_chat_template(text: str, where: str) -> None:
    """ValueError naming `where` and the line when `text` is not a Jinja template."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # the environment transformers renders chat templates in
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"{where} is not valid Jinja (line {exc.lineno}: {exc.message})") from None


def is_template_file(value: str) -> bool:
    """Whether `value` names a file (a chat template given by path). os.path.isfile, not Path.is_file: inline Jinja
    with a stretch between slashes longer than a file name may be makes Path.is_file raise ENAMETOOLONG on
    Python 3.11, where os.path.isfile says no."""
    return os.path.isfile(os.path.expanduser(value))
