"""Bounded JSON grammars, checked with xgrammar's GrammarMatcher on whole strings: numbers end at 17 significant
digits and a 3-digit exponent, integers at int64, no whitespace between tokens, keys in the schema's order; in
every place a number can sit (properties, items, $defs, allOf, type lists, untyped values, json_object)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from engine.structured import GrammarCompiler, StructuredOutputs
from engine.structured.json_bounds import json_schema_grammar
from tests.engine.tokenizers_for_tests import make_byte_level_tokenizer

NUMBER = {"type": "number"}
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}, "population_millions": NUMBER},
    "required": ["name", "country", "population_millions"],
}
# schema, how a number sits in one of its values ("%s": the number's text)
PLACES = [
    (NUMBER, "%s"),
    (CITY, '{"name":"Oslo","country":"Norway","population_millions":%s}'),
    ({"type": "array", "items": NUMBER}, "[1,%s]"),
    ({"$defs": {"n": NUMBER}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}}, '{"a":%s}'),
    ({"allOf": [NUMBER]}, "%s"),
    ({"type": ["number", "null"]}, "%s"),
    ({"anyOf": [NUMBER, {"type": "string"}]}, "%s"),
    ({"type": "object", "properties": {"a": {}}}, '{"a":%s}'),
    ({"type": "object", "additionalProperties": True}, '{"x":[%s]}'),
]
FITS = [
    "0",
    "-0.5",
    "12345678901234567",
    "-1234567890.1234567",
    "0.30000000000000004",
    "1.7976931348623157e308",
    "5e-324",
    "1E+300",
    "2.5e-7",
]
TOO_LONG = [
    "123456789012345678",
    "1234567890.12345678",
    "0.123456789012345678",
    "1e1000",
    "1.5e-0001",
    "111111111111111111111111",
]


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    """A vocabulary of the printable ASCII characters: any string is a sequence of tokens."""
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def accepts(compiler: xgr.GrammarCompiler, schema: dict, text: str, strict: bool = True) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(json_schema_grammar(json.dumps(schema), strict)))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("schema, shape", PLACES)
def test_numbers_end_at_17_significant_digits_and_a_3_digit_exponent(compiler, schema, shape):
    for number in FITS:
        assert accepts(compiler, schema, shape % number), (schema, number)
    for number in TOO_LONG:
        assert not accepts(compiler, schema, shape % number), (schema, number)


def test_json_object_numbers_are_bounded_too(compiler):
    assert accepts(compiler, {"type": "object"}, '{"a":12345678901234567}', strict=False)
    assert not accepts(compiler, {"type": "object"}, '{"a":123456789012345678}', strict=False)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer"},
        {"type": "integer", "minimum": -5},
        {"type": ["integer", "string"]},
        {"type": "array", "items": {"type": "integer"}},
    ],
)
def test_integers_are_what_int64_holds(compiler, schema):
    wrap = "[%s]" if schema.get("type") == "array" else "%s"
    assert accepts(compiler, schema, wrap % "9223372036854775807")
    assert not accepts(compiler, schema, wrap % "9223372036854775808")
    assert not accepts(compiler, schema, wrap % "12345678901234567890")
    assert accepts(compiler, schema, wrap % "-4")


def test_a_number_with_one_bound_gets_the_other(compiler):
    above = {"type": "number", "minimum": 0}
    assert accepts(compiler, above, "1.25") and accepts(compiler, above, "99999999999999999")
    assert not accepts(compiler, above, "1000000000000000000") and not accepts(compiler, above, "-1")
    below = {"type": "number", "exclusiveMaximum": 10}
    assert accepts(compiler, below, "-12345") and not accepts(compiler, below, "-1000000000000000000")


def test_no_whitespace_between_tokens(compiler):
    assert accepts(compiler, CITY, '{"name":"Oslo","country":"Norway","population_millions":0.7}')
    for text in (
        '{"name": "Oslo","country":"Norway","population_millions":0.7}',
        '{"name":"Oslo", "country":"Norway","population_millions":0.7}',
        '{ "name":"Oslo","country":"Norway","population_millions":0.7}',
        ' {"name":"Oslo","country":"Norway","population_millions":0.7}',
        '{"name":"Oslo","country":"Norway","population_millions":0.7 }',
        '{"name":"Oslo","country":"Norway","population_millions":0.7}\n',
    ):
        assert not accepts(compiler, CITY, text), text
    assert not accepts(compiler, {"type": "array", "items": NUMBER}, "[1, 2]")
    assert not accepts(compiler, {"type": "object"}, '{"a": 1}', strict=False)


def test_keys_in_the_schemas_order(compiler):
    assert not accepts(compiler, CITY, '{"country":"Norway","name":"Oslo","population_millions":0.7}')
    optional = {"type": "object", "properties": {"b": NUMBER, "a": NUMBER}}
    assert accepts(compiler, optional, '{"b":1,"a":2}') and accepts(compiler, optional, '{"a":2}')
    assert not accepts(compiler, optional, '{"a":2,"b":1}')


def test_a_string_that_looks_like_the_placeholder_stays_a_string(compiler):
    schema = {
        "type": "object",
        "properties": {"s": {"const": "pagedserve:bounded-number"}, "n": NUMBER},
        "required": ["s", "n"],
    }
    assert accepts(compiler, schema, '{"s":"pagedserve:bounded-number","n":1.5}')
    assert not accepts(compiler, schema, '{"s":1.5,"n":1.5}')


def test_the_engines_compiler_applies_the_bounds():
    """json and json_object constraints as requests give them: canonical text keeps the properties' order."""
    tokenizer = make_byte_level_tokenizer()
    engine_compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id or 0}))

    def fits(value: dict, text: str) -> bool:
        matcher = xgr.GrammarMatcher(engine_compiler.compile(StructuredOutputs.parse(value)))
        return matcher.accept_string(text) and matcher.is_completed()

    city = '{"name":"Oslo","country":"Norway","population_millions":%s}'
    assert fits({"json": CITY}, city % "0.7")
    assert not fits({"json": CITY}, city % "123456789012345678")
    assert not fits({"json": CITY}, '{"country":"Norway","name":"Oslo","population_millions":0.7}')
    assert fits({"json_object": True}, '{"a":[1,2.5]}')
    assert not fits({"json_object": True}, '{"a":123456789012345678}')
    assert not fits({"json_object": True}, '{"a": 1}')
