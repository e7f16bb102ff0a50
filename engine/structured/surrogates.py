"""Grammars that generate only valid UTF-8: no UTF-16 surrogates (U+D800-U+DFFF) in their character classes.

xgrammar turns a character class into byte sequences over every code point it covers, and a class such as a JSON
string's `[^"\\\\\\r\\n]` or a regex's `.` (`[\\0-\\U0010ffff]`) covers the surrogates too. Their 3-byte
encodings (ED A0 80 to ED BF BF) are not UTF-8, so a byte-level model that samples one writes text that decodes to
three U+FFFD, and a string the grammar bounded to 5 characters comes out 7 long. Every class outside a quoted
literal is edited here: a negated one also excludes the surrogates, a positive one loses the part of its ranges
that falls among them. Regex("...") bodies (JSON Schema patterns) are left as they are.

A JSON grammar's strings are also held to JSON's own rule (`json_strings`): a control character U+0000-U+001F
appears in a string only escaped. xgrammar's unbounded string class excludes them, its bounded one
(`maxLength`, `minLength`) only CR and LF, so a tab or a U+0001 came out raw and a strict parser refused the output.

xgrammar prints a code point up to U+00FF as `\\x` and two hex digits but reads `\\x` with as many hex digits as
follow, so its printed `[\\xe9a]` (é or a) reads back as U+0E9A: every such escape outside a Regex body is
widened to `\\U000000e9` here, in classes and in literals alike (`\\u` and `\\U` are read at their fixed widths).
"""

from __future__ import annotations

from typing import Optional

SURROGATES = (0xD800, 0xDFFF)
_EXCLUDE = "\\uD800-\\uDFFF"
_CONTROLS = "\\0-\\U0000001f"
_SIMPLE_ESCAPES = {
    "n": 0x0A, "r": 0x0D, "t": 0x09, "a": 0x07, "b": 0x08, "f": 0x0C, "v": 0x0B, "e": 0x1B,
    "\\": 0x5C, '"': 0x22, "'": 0x27, "?": 0x3F, "]": 0x5D, "-": 0x2D, "[": 0x5B, "^": 0x5E, "0": 0x00,
}  # fmt: skip
_HEX_ESCAPES = {"u": 4, "U": 8}  # fixed widths; `\\xNN` is widened to `\\U` before a class is read
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def without_surrogates(ebnf: str, json_strings: bool = False) -> str:
    """`ebnf` (xgrammar's dialect) with no character class that admits a surrogate; `json_strings` (a JSON
    grammar): a negated class that excludes `"` (a string's characters) excludes the control characters too."""
    out: list[str] = []
    i, n = 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c == '"':  # a quoted literal: its \\x escapes widened, a Regex body copied as it is
            j = i + 1
            while j < n and ebnf[j] != '"':
                j += 2 if ebnf[j] == "\\" else 1
            literal = ebnf[i : j + 1]
            out.append(literal if ebnf.endswith("Regex(", 0, i) else _widen_hex(literal))
            i = j + 1
        elif c == "[":
            j = _class_end(ebnf, i)
            out.append(_edit_class(_widen_hex(ebnf[i : j + 1]), json_strings))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _widen_hex(text: str) -> str:
    """`text` (a literal or a class) with each `\\xNN` escape written `\\U000000NN`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            digits = text[i + 2 : i + 4]
            if text[i + 1] == "x" and len(digits) == 2 and all(d in _HEX_DIGITS for d in digits):
                out.append(f"\\U000000{digits}")
                i += 4
            else:
                out.append(text[i : i + 2])
                i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _class_end(text: str, start: int) -> int:
    """The index of the `]` that closes the class opened at `start`."""
    j = start + 1
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j


def _edit_class(cls: str, json_strings: bool) -> str:
    """One class, `[...]` or `[^...]`, without the surrogates (and in a JSON string without the controls);
    unchanged when it cannot hold one or is not understood."""
    if cls.startswith("[^"):
        # (xgrammar's unbounded string class excludes them already: left as it is)
        controls = _CONTROLS if json_strings and '\\"' in cls and _CONTROLS not in cls else ""
        return f"{cls[:-1]}{controls}{_EXCLUDE}]"
    ranges = _ranges(cls[1:-1])
    low, high = SURROGATES
    if ranges is None or not any(a <= high and b >= low for a, b in ranges):
        return cls
    kept: list[tuple[int, int]] = []
    for a, b in ranges:
        if b < low or a > high:
            kept.append((a, b))
            continue
        if a < low:
            kept.append((a, low - 1))
        if b > high:
            kept.append((high + 1, b))
    if not kept:  # only surrogates: a class that matches nothing would not compile; exclude everything else
        return "[^\\0-\\U0010ffff]"
    return "[" + "".join(_escape(a) if a == b else f"{_escape(a)}-{_escape(b)}" for a, b in kept) + "]"


def _ranges(body: str) -> Optional[list[tuple[int, int]]]:
    """The code point ranges of a positive class's body, or None for a form this parser does not know."""
    ranges: list[tuple[int, int]] = []
    i, dash = 0, False  # dash: a `-` after a member, so the next member ends a range
    while i < len(body):
        c = body[i]
        if c == "-" and ranges and not dash:
            dash, i = True, i + 1
            continue
        if c == "\\":
            e = body[i + 1 : i + 2]
            if e in _SIMPLE_ESCAPES:
                point, i = _SIMPLE_ESCAPES[e], i + 2
            elif e in _HEX_ESCAPES:
                digits = body[i + 2 : i + 2 + _HEX_ESCAPES[e]]
                if len(digits) != _HEX_ESCAPES[e] or any(d not in _HEX_DIGITS for d in digits):
                    return None
                point, i = int(digits, 16), i + 2 + len(digits)
            else:
                return None
        else:
            point, i = ord(c), i + 1
        if dash:
            start = ranges.pop()[0]
            if point < start:
                return None
            ranges.append((start, point))
            dash = False
        else:
            ranges.append((point, point))
    if dash:  # a trailing `-` is itself a member
        ranges.append((ord("-"), ord("-")))
    return ranges


def _escape(point: int) -> str:
    return f"\\U{point:08x}"
