"""A token's raw bytes (logprobs `bytes`): joined over a text's tokens they give the text's UTF-8, also where a
token holds only part of a character, on both tokenizer kinds."""

from __future__ import annotations

import pytest

from engine.text.token_bytes import token_bytes_reader
from engine.text.tokenizer import Tokenizer
from server.openai.logprob_format import LogprobFormatter
from tests.engine.tokenizers_for_tests import (
    byte_fallback_ids,
    byte_level_ids,
    make_byte_level_tokenizer,
    make_sentencepiece_tokenizer,
)

TEXTS = ["plain words", "日本語 🎉🎉 ok", "é\u0301 mixed 中文 and tabs\t"]


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("text", TEXTS)
def test_raw_bytes_join_into_the_text(kind, text):
    hf = make_byte_level_tokenizer() if kind == "byte_level" else make_sentencepiece_tokenizer()
    read = token_bytes_reader(hf)
    assert read is not None
    ids = hf.encode(text, add_special_tokens=False)
    data = b"".join(read(i) for i in ids)
    # sentencepiece writes a leading space (▁) its decoder strips from the text's start
    assert data == text.encode() if kind == "byte_level" else data in (text.encode(), b" " + text.encode())
    # and one token per byte, however a character is cut
    spelled = byte_level_ids(hf, text.encode()) if kind == "byte_level" else byte_fallback_ids(hf, text.encode())
    assert b"".join(read(i) for i in spelled) == text.encode()


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_logprob_bytes_of_partial_characters_are_the_tokens_own(kind):
    hf = make_byte_level_tokenizer() if kind == "byte_level" else make_sentencepiece_tokenizer()
    formatter = LogprobFormatter(Tokenizer(hf=hf, eos_token_ids=frozenset(), max_token_id=len(hf) - 1))
    spelled = byte_level_ids(hf, "🎉".encode()) if kind == "byte_level" else byte_fallback_ids(hf, "🎉".encode())
    entries = [formatter._token(i) for i in spelled]
    assert all(text == "\ufffd" for text, _ in entries)  # each alone decodes to the replacement character
    assert bytes(b for _, data in entries for b in data) == "🎉".encode()
    # whole characters keep their text's UTF-8; specials have no raw bytes and keep theirs too
    for word in hf.encode("plain words", add_special_tokens=False):
        text, data = formatter._token(word)
        assert "\ufffd" not in text and bytes(data) == text.encode()
    special = hf.convert_tokens_to_ids(hf.all_special_tokens[0])
    text, data = formatter._token(special)
    assert bytes(data) == text.encode()
