"""bad_words as vLLM reads them: the token sequences of each word (engine/sampling/bad_words.py) and the tokens
they mask after a given output."""

from __future__ import annotations

import pytest

from engine.errors import TokenIdOutOfVocabularyError
from engine.sampling.bad_words import bad_words_token_ids, masked_by_bad_words

# a toy tokenizer: a space-led word is one token (" cat" -> 7) where it knows one, else a token per character
SPACED = {" cat": [7], " dog": [8, 9]}
CHARS = {c: 100 + ord(c) - ord("a") for c in "abcdefghijklmnopqrstuvwxyz"}


def encode(text: str) -> list[int]:
    if text in SPACED:
        return SPACED[text]
    return [CHARS[c] if c in CHARS else 1 for c in text]


def test_each_word_at_a_start_and_after_a_space():
    """ " cat" is another single token than "cat"'s first, as many tokens: both sequences; " dog" tokenizes to
    another length than "dog": only the bare one (vLLM's rule); leading spaces of a word are dropped first."""
    assert bad_words_token_ids(encode, ["cat", " dog"], 1000) == [
        [CHARS["c"], CHARS["a"], CHARS["t"]],
        [CHARS["d"], CHARS["o"], CHARS["g"]],
    ]
    assert bad_words_token_ids(encode, ["x"], 1000) == [[CHARS["x"]]]
    one = {**SPACED, " x": [5]}
    assert bad_words_token_ids(lambda t: one.get(t) or [CHARS[c] for c in t], ["x"], 1000) == [[CHARS["x"]], [5]]


def test_a_token_past_the_vocabulary_is_refused():
    with pytest.raises(TokenIdOutOfVocabularyError) as info:
        bad_words_token_ids(encode, ["cat"], 101)
    assert info.value.field == "bad_words"


@pytest.mark.parametrize(
    "output, masked",
    [
        ([], [3]),  # a one-token word is masked always; [1, 2] needs its 1 written first
        ([5, 1], [3, 2]),
        ([1, 2], [3]),  # [1, 2] is complete: its last token is only masked while it is due
        ([4, 1, 1], [3, 2]),
    ],
)
def test_the_last_token_is_masked_where_the_output_ends_with_the_rest(output, masked):
    assert masked_by_bad_words([[3], [1, 2], [9, 9, 9, 9]], output) == masked
