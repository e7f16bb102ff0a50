"""The detokenizer's two paths: DecodeStream for Rust-backed tokenizers, the Python loop for the rest.

Both must stream exactly the same deltas; the Python loop takes over a fast
tokenizer's window where DecodeStream would go wrong.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from engine.text.detokenizer import IncrementalDetokenizer
from tests.engine.test_detokenizer import detok_cases, reference, split
from tests.engine.tokenizers_for_tests import (
    byte_fallback_ids,
    byte_level_ids,
    make_byte_level_tokenizer,
    make_sentencepiece_tokenizer,
)


class PythonOnlyTokenizer:
    """A fast tokenizer seen without its Rust backend, as a slow (Python) tokenizer is."""

    def __init__(self, fast):
        self._fast = fast

    def decode(self, ids, skip_special_tokens, spaces_between_special_tokens, clean_up_tokenization_spaces):
        return self._fast.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=clean_up_tokenization_spaces
        )


@pytest.fixture(scope="module")
def tokenizers_by_name():
    return {"byte_level": make_byte_level_tokenizer(), "sentencepiece": make_sentencepiece_tokenizer()}


def deltas(tokenizer, prompt, chunks, skip) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    return [detok.add_tokens(chunk) for chunk in chunks] + [detok.flush()]


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "show_special"])
@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_stream_and_python_loop_emit_the_same_deltas(tokenizers_by_name, name, skip):
    fast = tokenizers_by_name[name]
    slow = PythonOnlyTokenizer(fast)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(detok_cases(fast, name))
    def check(case):
        prompt, output, sizes = case
        chunks = split(output, sizes)
        streamed = deltas(fast, prompt, chunks, skip)
        assert streamed == deltas(slow, prompt, chunks, skip)
        expected = reference(fast, prompt, output, skip)
        if expected is not None:
            assert "".join(streamed) == expected

    check()


def test_a_fast_tokenizer_streams_and_a_slow_one_loops(tokenizers_by_name):
    fast = tokenizers_by_name["byte_level"]
    prompt = fast.encode("Hello there", add_special_tokens=False)
    assert IncrementalDetokenizer(fast, prompt)._stream is not None
    assert IncrementalDetokenizer(PythonOnlyTokenizer(fast), prompt)._stream is None


def test_a_prompt_ending_inside_a_character_starts_in_the_python_loop(tokenizers_by_name):
    """DecodeStream would take a context whose text ends in U+FFFD as no context, and emit it."""
    tok = tokenizers_by_name["byte_level"]
    prompt = tok.encode("Say:", add_special_tokens=False) + byte_level_ids(tok, "😀".encode()[:1])
    bang = tok.encode("!", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok._stream is None
    assert detok.add_tokens(bang) + detok.flush() == "!" == reference(tok, prompt, bang, True)


def test_the_python_loop_takes_over_when_the_decoder_rewrites_settled_text(tokenizers_by_name):
    """<0xE4><0xB8><0xAD> streams "中"; <0x80> after it makes the decoder rewrite it as 4 x U+FFFD."""
    tok = tokenizers_by_name["sentencepiece"]
    detok = IncrementalDetokenizer(tok, tok.encode("Hi", add_special_tokens=False))
    assert detok.add_tokens(byte_fallback_ids(tok, "中".encode())) == "中"
    assert detok._stream is not None
    stray = byte_fallback_ids(tok, b"\x80") + tok.encode(" ok", add_special_tokens=False)
    assert detok.add_tokens(stray) == "\ufffd ok"
    assert detok._stream is None
    assert detok.add_tokens(tok.encode(" then", add_special_tokens=False)) == " then"
