"""Lark grammars in a `grammar` constraint, as vLLM takes them beside EBNF (GBNF).

vLLM reads a grammar with no `::=` rule as Lark (its `grammar_is_likely_lark`), and then takes its first rule as the
root when it has no `start` rule, and a single-quoted literal as a double-quoted one. xgrammar compiles Lark itself
(`Grammar.from_lark`: terminals, regular expressions, `~` repetition, `%import common`, `%ignore`) but wants a
`start` rule and double quotes; `lark_source` gives it those.
"""

from __future__ import annotations

import json
import re

_COMMENT = re.compile(r"(#|//).*$")
# a rule or terminal's definition: `name:`, `?name:`, `!name:`, `NAME.2:` (not `::=`)
_DEFINITION = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?\s*:(?!:)")


def is_lark(grammar: str) -> bool:
    """Whether `grammar` reads as Lark: no line (comments aside) defines a rule with EBNF's `::=`."""
    return not any("::=" in _COMMENT.sub("", line) for line in grammar.splitlines())


def lark_source(grammar: str) -> str:
    """`grammar` as xgrammar's Lark reader takes it: single-quoted literals double-quoted, and a `start` rule (the
    first rule) when it has none."""
    text = _double_quoted(grammar)
    names = [m.group(1) for m in map(_DEFINITION.match, text.splitlines()) if m is not None]
    if names and "start" not in names:
        text = f"start: {names[0]}\n{text}"
    return text


def _double_quoted(text: str) -> str:
    """`text` with each 'literal' outside a "string", a /regex/ and a comment written as a JSON string."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char == '"':  # a double-quoted literal, copied as is
            end = _closing(text, i, '"')
            out.append(text[i:end])
            i = end
        elif text.startswith("//", i) or char == "#":  # a comment, to the end of its line
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(text[i:end])
            i = end
        elif char == "/":  # a regular expression /.../flags, copied as is
            end = _closing(text, i, "/")
            out.append(text[i:end])
            i = end
        elif char == "'":
            end = _closing(text, i, "'")
            body = text[i + 1 : end - 1] if end - 1 > i and text[end - 1] == "'" else text[i + 1 : end]
            out.append(json.dumps(_unescape_single(body), ensure_ascii=False))
            i = end
        else:
            out.append(char)
            i += 1
    return "".join(out)


def _closing(text: str, start: int, quote: str) -> int:
    """One past the `quote` closing the literal opened at `start` (backslash escapes skipped; the line's end when
    it is not closed)."""
    i = start + 1
    while i < len(text) and text[i] != "\n":
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            return i + 1
        i += 1
    return min(i, len(text))


def _unescape_single(body: str) -> str:
    r"""A single-quoted literal's text: `\'` is a quote, `\\` a backslash, other escapes as JSON reads them."""
    out: list[str] = []
    i = 0
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if nxt in "'\\":
                out.append(nxt)
            else:
                try:
                    out.append(json.loads(f'"\\{nxt}"'))
                except ValueError:
                    out.append("\\" + nxt)
            i += 2
            continue
        out.append(body[i])
        i += 1
    return "".join(out)
