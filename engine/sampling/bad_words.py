"""`bad_words` as token sequences, as vLLM's `SamplingParams.update_from_tokenizer` makes them: each word as a
text's start ("word") and, where that gives another first token but as many tokens, after a space (" word"), so that
the word is masked at the output's start and inside it alike."""

from __future__ import annotations

from typing import Callable, Sequence

from engine.errors import TokenIdOutOfVocabularyError


def bad_words_token_ids(encode: Callable[[str], list[int]], words: Sequence[str], vocab_size: int) -> list[list[int]]:
    """`encode`: the tokenizer's, without special tokens."""
    sequences: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        spaced = encode(" " + word.lstrip())
        sequences.append(bare)
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    for token_id in (t for sequence in sequences for t in sequence):
        if not 0 <= token_id < vocab_size:  # a tokenizer larger than the model's embedding
            raise TokenIdOutOfVocabularyError("bad_words", token_id, vocab_size)
    return sequences


def masked_by_bad_words(sequences: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens the next position may not take: each sequence's last, where the output ends with the rest of it
    (vLLM looks at the output alone, not the prompt)."""
    masked = []
    for sequence in sequences:
        prefix = len(sequence) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or list(output_token_ids[-prefix:]) == list(sequence[:prefix]):
            masked.append(sequence[-1])
    return masked
