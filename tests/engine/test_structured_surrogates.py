"""Constrained outputs are valid UTF-8: the JSON and regex grammars admit no UTF-16 surrogate (engine/structured/
surrogates.py), and JSON strings no raw control character. Checked on the class editor's text, then byte by byte
with xgrammar's GrammarMatcher over a byte-level vocabulary, through the engine's own GrammarCompiler."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from engine.structured import GrammarCompiler, StructuredOutputs
from engine.structured.surrogates import without_surrogates
from tests.engine.tokenizers_for_tests import make_byte_level_tokenizer

SURROGATE = "\ud83d".encode("utf-8", "surrogatepass")  # ED A0 BD: what a byte-level model can sample
CJK = "。".encode()  # E3 80 82: a valid 3-byte character
EMOJI = "🙂".encode()  # 4 bytes


def test_negated_classes_also_exclude_the_surrogates():
    edited = without_surrogates('s ::= [^\\0-\\x1f\\"\\\\\\r\\n] s | "x"\nt ::= [^\\"\\\\\\r\\n]{0, 5}')
    assert (
        edited
        == 's ::= [^\\0-\\U0000001f\\"\\\\\\r\\n\\uD800-\\uDFFF] s | "x"\nt ::= [^\\"\\\\\\r\\n\\uD800-\\uDFFF]{0, 5}'
    )


def test_json_string_classes_also_exclude_the_controls():
    text = 's ::= [^\\0-\\x1f\\"\\\\\\r\\n] s | "x"\nt ::= [^\\"\\\\\\r\\n]{0, 5}\nu ::= [^a] Regex("[^\\"]")'
    assert without_surrogates(text, json_strings=True) == (
        's ::= [^\\0-\\U0000001f\\"\\\\\\r\\n\\uD800-\\uDFFF] s | "x"\n'  # (already without them)
        't ::= [^\\"\\\\\\r\\n\\0-\\U0000001f\\uD800-\\uDFFF]{0, 5}\n'
        'u ::= [^a\\uD800-\\uDFFF] Regex("[^\\"]")'  # not a string's class; a pattern stays as written
    )


def test_positive_classes_lose_only_the_surrogate_part():
    assert without_surrogates("r ::= [\\0-\\U0010ffff]") == "r ::= [\\U00000000-\\U0000d7ff\\U0000e000-\\U0010ffff]"
    assert without_surrogates("r ::= [a\\uD800-\\uDBFFz]") == "r ::= [\\U00000061\\U0000007a]"
    assert without_surrogates("r ::= [\\uD800-\\uDFFF]") == "r ::= [^\\0-\\U0010ffff]"  # matches nothing still
    for kept in ("r ::= [0-9]", "r ::= [ \\n\\r\\t]* [,}\\]:]", "r ::= [+\\-]", "r ::= [a-]"):
        assert without_surrogates(kept) == kept


def test_quoted_literals_and_regex_bodies_stay_as_written():
    text = 'r ::= "[^a]" Regex("[^\\"]+", json_string=true) "\\"[x]"'
    assert without_surrogates(text) == text


def test_edited_grammars_still_compile_and_mean_the_rest():
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammar = without_surrogates(str(xgr.Grammar.from_regex("[^a]{2}-.")))
    for text, ok in (("xy-z", True), ("ay-z", False), ("xy-", False)):
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, text


@pytest.fixture(scope="module")
def byte_tokens():
    """The engine's GrammarCompiler over a byte-level vocabulary, and each byte's single-byte token."""
    tokenizer = make_byte_level_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id or 0}))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    single = {}
    for token, raw in enumerate(info.decoded_vocab):
        if len(raw) == 1:
            single.setdefault(raw[0], token)
    assert len(single) == 256
    return compiler, single


def _accepts(byte_tokens, constraint: dict, data: bytes) -> bool:
    compiler, single = byte_tokens
    matcher = xgr.GrammarMatcher(compiler.compile(StructuredOutputs.parse(constraint)))
    return all(matcher.accept_token(single[b]) for b in data) and matcher.is_completed()


@pytest.mark.parametrize(
    "constraint, before, after",
    [
        ({"json": {"type": "string", "maxLength": 5}}, b'"a', b'"'),  # the bounded string class
        ({"json": {"type": "object", "properties": {"a": {"type": "string"}}}}, b'{"a":"', b'"}'),
        ({"json_object": True}, b'{"', b'":1}'),
        ({"regex": "x.{1,2}"}, b"x", b""),
    ],
    ids=["bounded-string", "string", "json_object", "regex"],
)
def test_no_surrogate_gets_through(byte_tokens, constraint, before, after):
    assert _accepts(byte_tokens, constraint, before + CJK + after)
    assert _accepts(byte_tokens, constraint, before + EMOJI + after)
    assert not _accepts(byte_tokens, constraint, before + SURROGATE + after)


@pytest.mark.parametrize(
    "constraint, before, after, escapes",
    [
        ({"json": {"type": "string", "maxLength": 5}}, b'"a', b'"', False),  # xgrammar's bounded strings: no escapes
        (
            {"json": {"type": "object", "properties": {"a": {"type": "string", "minLength": 1}}}},
            b'{"a":"',
            b'"}',
            False,
        ),
        ({"json": {"type": "object", "properties": {"a": {"type": "string"}}}}, b'{"a":"', b'"}', True),
        ({"json_object": True}, b'{"', b'":1}', True),
    ],
    ids=["bounded-string", "bounded-property", "string", "json_object"],
)
def test_json_strings_hold_controls_only_escaped(byte_tokens, constraint, before, after, escapes):
    """JSON allows U+0000-U+001F in a string only as an escape: a raw tab or U+0001 is refused, and the text is
    still taken (with the escape where the grammar has escapes)."""
    for raw in (b"\t", b"\x01", b"\x1f", b"\n"):
        assert not _accepts(byte_tokens, constraint, before + raw + after), raw
    assert _accepts(byte_tokens, constraint, before + b"x y~" + after)
    assert _accepts(byte_tokens, constraint, before + b"\\t" + after) == escapes


def test_xgrammar_alone_lets_a_raw_tab_into_a_bounded_string(byte_tokens):
    """Why `json_strings` exists: the bounded string as xgrammar writes it takes a raw tab."""
    compiler, single = byte_tokens
    grammar = compiler.compiler().compile_grammar(str(xgr.Grammar.from_json_schema('{"type":"string","maxLength":5}')))
    matcher = xgr.GrammarMatcher(grammar)
    assert all(matcher.accept_token(single[b]) for b in b'"a\t"') and matcher.is_completed()


def test_xgrammar_alone_lets_the_surrogate_through(byte_tokens):
    """Why the edit exists: the same bounded string compiled as xgrammar writes it takes the 3 surrogate bytes."""
    compiler, single = byte_tokens
    grammar = compiler.compiler().compile_grammar(str(xgr.Grammar.from_json_schema('{"type":"string","maxLength":5}')))
    matcher = xgr.GrammarMatcher(grammar)
    assert all(matcher.accept_token(single[b]) for b in b'"a' + SURROGATE + b'"') and matcher.is_completed()


def test_latin1_escapes_read_back_as_printed():
    """xgrammar prints `\\xe9` and reads `\\x` greedily (`[\\xe9a]` would be U+0E9A): widened, é and `a` stay two."""
    assert without_surrogates('r ::= [\\xe9a] "\\xe9a" Regex("\\xe9a")') == (
        'r ::= [\\U000000e9a] "\\U000000e9a" Regex("\\xe9a")'
    )
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["é"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def accepts(grammar: str, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(without_surrogates(grammar)))
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts(str(xgr.Grammar.from_regex("[éa]")), "a") and accepts(str(xgr.Grammar.from_regex("[éa]")), "é")
    assert accepts(str(xgr.Grammar.from_regex("[é0-9]")), "7")
    assert not accepts(str(xgr.Grammar.from_regex("[^éa]")), "a") and accepts(str(xgr.Grammar.from_regex("[^éa]")), "b")
    assert accepts(str(xgr.Grammar.from_json_schema('{"enum": ["éa"]}')), '"éa"')


def test_every_escape_xgrammar_prints_in_a_class_is_understood(byte_tokens):
    """`[\\s\\S]` prints as `[\\f\\n\\r\\t\\v ...]`; \\a, \\e, \\' and \\? appear too: none leaves a class unedited."""
    for regex in ("[\\s\\S]", "[\\x07-\\U0010ffff]", "[\\x1b-\\U0010ffff]", "['-\\U0010ffff]", "[?-\\U0010ffff]"):
        assert not _accepts(byte_tokens, {"regex": regex}, SURROGATE), regex
        assert _accepts(byte_tokens, {"regex": regex}, CJK), regex
