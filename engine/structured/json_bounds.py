"""Bounded JSON: the grammar of a JSON Schema (or json_object) in which every value ends where its meaning ends.

A grammar that lets a number's digits or the whitespace between tokens go on forever lets a small model write
`"population_millions": 1111111...` until max_tokens. So a JSON constraint is compiled with:

    numbers      at most 17 significant digits, integer part plus fraction (what a float64 holds; after "0." up
                 to 17 fraction digits), and an exponent of at most 3 digits; a number with only one bound gets
                 the other 1e17 beyond it (xgrammar writes a bounded number as a decimal with at most 6 fraction
                 digits)
    integers     what an int64 holds: their missing bounds are int64's
    whitespace   none between tokens, `{"a":1,"b":[2,3]}`, as OpenAI's strict structured outputs write it
    keys         in the schema's order, and no key the schema does not name unless it allows them

xgrammar (0.2.x) has options for whitespace and key order (`any_whitespace=False`, `separators`,
`any_order=False`, `strict_mode`) but none for digits, and its bounded-integer ranges are exact. So the schema
is transformed before xgrammar converts it to EBNF (integers get int64 bounds, unbounded numbers become a
placeholder constant), and the EBNF is edited after: the placeholder, and the `basic_number` / `basic_integer`
rules that untyped values use (`{}`, json_object, open objects), become the bounded rules below.
"""

from __future__ import annotations

import json
import re
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_SIGNIFICANT_DIGITS = 17
MAX_EXPONENT_DIGITS = 3
MAX_INTEGER_DIGITS = 19  # an untyped value's integer (basic_integer): int64's width
NUMBER_SPAN = 10**17  # a number with one bound may go this far beyond it
SEPARATORS = (",", ":")

_PLACEHOLDER = "pagedserve:bounded-number"
_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")


def json_schema_grammar(schema_text: str, strict: bool = True) -> str:
    """The bounded EBNF (xgrammar's dialect) of the JSON Schema `schema_text`; `strict`: objects hold only the
    keys their schema names unless it allows more. Raises xgrammar's errors for a schema it cannot convert."""
    import xgrammar as xgr

    placeholder = _PLACEHOLDER
    while placeholder in schema_text:
        placeholder += "~"
    schema = bounded_schema(json.loads(schema_text), placeholder)
    grammar = xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False, separators=SEPARATORS, strict_mode=strict, any_order=False
    )
    return bound_numbers(str(grammar), placeholder)


def bounded_schema(schema: Any, placeholder: str) -> Any:
    """A copy of `schema` whose integers have both bounds, whose numbers with one bound have both, and whose
    numbers without a bound are the constant `placeholder` (or an anyOf of it and the schema's other types)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for keyword in _SCHEMA_MAPS:
        if isinstance(out.get(keyword), dict):
            out[keyword] = {name: bounded_schema(child, placeholder) for name, child in out[keyword].items()}
    for keyword in _SCHEMA_LISTS:
        if isinstance(out.get(keyword), list):
            out[keyword] = [bounded_schema(child, placeholder) for child in out[keyword]]
    for keyword in _SCHEMA_VALUES:
        if keyword in out:
            out[keyword] = bounded_schema(out[keyword], placeholder)
    return _bounded_node(out, placeholder)


def bound_numbers(ebnf: str, placeholder: str) -> str:
    """xgrammar's EBNF with the placeholder constant and its unbounded number rules replaced by bounded ones."""
    literal = '"\\"' + placeholder + '\\""'  # the constant as xgrammar prints it: the JSON string, quoted
    ebnf = ebnf.replace(literal, number_ebnf())
    if placeholder in ebnf:
        raise AssertionError(f"xgrammar printed the number placeholder in an unexpected form: {ebnf[:2000]}")
    ebnf = re.sub(r"^basic_number ::= .*$", lambda _: f"basic_number ::= {number_ebnf()}", ebnf, flags=re.M)
    return re.sub(r"^basic_integer ::= .*$", lambda _: f"basic_integer ::= {integer_ebnf()}", ebnf, flags=re.M)


def number_ebnf() -> str:
    """A JSON number of at most 17 significant digits and an exponent of at most 3 digits, as one EBNF group.

    rest(n): what may follow once n more digits are allowed
             ""  |  "." [0-9]{1,n}  |  [0-9] rest(n - 1)        rest(0) = ""
    """
    rest = '""'
    for n in range(1, MAX_SIGNIFICANT_DIGITS):
        rest = f'("" | "." [0-9]{{1,{n}}} | [0-9] {rest})'
    mantissa = f'("0" ("." [0-9]{{1,{MAX_SIGNIFICANT_DIGITS}}})? | [1-9] {rest})'
    exponent = f"([eE] [+\\-]? [0-9]{{1,{MAX_EXPONENT_DIGITS}}})?"
    return f'("-"? {mantissa} {exponent})'


def integer_ebnf() -> str:
    """A JSON integer of at most 19 digits, as one EBNF group."""
    return f'("0" | "-"? [1-9] [0-9]{{0,{MAX_INTEGER_DIGITS - 1}}})'


def _bounded_node(node: dict, placeholder: str) -> dict:
    if "enum" in node or "const" in node:
        return node
    kind = node.get("type")
    types = kind if isinstance(kind, list) else [kind]
    if "number" in types:
        if _has_side(node, _LOWER) or _has_side(node, _UPPER):
            return _fill_sides(node, lower=-NUMBER_SPAN, upper=NUMBER_SPAN, relative=True)
        others = [t for t in types if t not in ("number", "integer")]
        if not others:
            return {"const": placeholder}
        return {"anyOf": [{"const": placeholder}, {**node, "type": others}]}
    if "integer" in types:
        return _fill_sides(node, lower=INT64_MIN, upper=INT64_MAX, relative=False)
    return node


def _fill_sides(node: dict, lower: int, upper: int, relative: bool) -> dict:
    """`node` with its missing lower / upper bound set (`relative`: that far beyond the other bound)."""
    out = dict(node)
    low, high = _bound(node, _LOWER), _bound(node, _UPPER)
    if not _has_side(node, _LOWER):
        out["minimum"] = (min(high, 0) + lower) if relative and high is not None else min(lower, high or 0)
    if not _has_side(node, _UPPER):
        out["maximum"] = (max(low, 0) + upper) if relative and low is not None else max(upper, low or 0)
    return out


def _has_side(node: dict, keywords: tuple[str, str]) -> bool:
    """Whether a bound keyword of this side is present (a draft-4 boolean exclusive flag is not a bound)."""
    return any(k in node and not isinstance(node[k], bool) for k in keywords)


def _bound(node: dict, keywords: tuple[str, str]):
    for keyword in keywords:
        value = node.get(keyword)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None
