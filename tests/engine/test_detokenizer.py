"""IncrementalDetokenizer on real in-memory tokenizers: byte-level BPE and sentencepiece-style BPE."""

from __future__ import annotations

from typing import Optional, Sequence

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine.text.detokenizer import IncrementalDetokenizer
from tests.engine.tokenizers_for_tests import (
    byte_fallback_ids,
    byte_level_ids,
    make_byte_level_tokenizer,
    make_sentencepiece_tokenizer,
    partial_character_ids,
    training_corpus,
)

MULTILINGUAL = "Café 中文 😀 naïve 👍🏽 日本語 한국 🇫🇷 end"


@pytest.fixture(scope="session")
def byte_level():
    return make_byte_level_tokenizer()


@pytest.fixture(scope="session")
def sentencepiece():
    return make_sentencepiece_tokenizer()


@pytest.fixture(scope="session", params=["byte_level", "sentencepiece"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def stream(tokenizer, prompt: Sequence[int], chunks: Sequence[Sequence[int]], skip: bool = True) -> list[str]:
    """Every delta, one per chunk, then flush()."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas = [detok.add_tokens(chunk) for chunk in chunks]
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    return deltas


def reference(tokenizer, prompt: Sequence[int], output: Sequence[int], skip: bool) -> Optional[str]:
    """decode(prompt + output) minus decode(prompt); None when the latter is not a prefix."""
    full = tokenizer.decode(list(prompt) + list(output), skip_special_tokens=skip)
    head = tokenizer.decode(list(prompt), skip_special_tokens=skip)
    return full[len(head) :] if full.startswith(head) else None


def split(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    chunks, i = [], 0
    for size in sizes:
        chunks.append(list(ids[i : i + size]))
        i += size
    if i < len(ids):
        chunks.append(list(ids[i:]))
    return chunks


CHARACTERS = "aé中文😀👍🏽🇫🇷한ßЖ\n "


def byte_piece_ids(tokenizer) -> frozenset[int]:
    """Sentencepiece `<0x..>` ids (empty for a byte-level vocabulary)."""
    return frozenset(
        i
        for i, piece in enumerate(tokenizer.convert_ids_to_tokens(range(len(tokenizer))))
        if piece.startswith("<0x") and len(piece) == 6
    )


def detok_cases(tokenizer, name: str) -> st.SearchStrategy:
    """(prompt, output, chunk sizes).

    Byte-level: any ids at all, biased towards pieces of multi-byte characters and
    special tokens. Sentencepiece: ordinary pieces, specials and whole characters
    spelled in byte tokens, optionally ending in an unfinished character: the
    decoder renders a byte run that is invalid UTF-8 as a whole with one U+FFFD
    per byte, which no stream can match once it has emitted part of the run.
    """
    specials = st.sampled_from(tokenizer.all_special_ids)
    if name == "byte_level":
        token = st.one_of(
            st.integers(0, len(tokenizer) - 1), st.sampled_from(partial_character_ids(tokenizer)), specials
        )
        output = st.lists(token, max_size=40)
        random_prompt = st.lists(token, max_size=8)
    else:
        bytes_ = byte_piece_ids(tokenizer)
        ordinary = st.sampled_from([i for i in range(len(tokenizer)) if i not in bytes_])
        spelled = st.sampled_from(CHARACTERS).map(lambda ch: byte_fallback_ids(tokenizer, ch.encode()))
        unit = st.one_of(ordinary.map(lambda i: [i]), spelled, specials.map(lambda i: [i]))
        unfinished = tokenizer.convert_tokens_to_ids(["▁"]) + byte_fallback_ids(tokenizer, "😀".encode()[:3])
        output = st.tuples(st.lists(unit, max_size=20), st.sampled_from([[], unfinished])).map(
            lambda units_tail: [i for u in units_tail[0] for i in u] + units_tail[1]
        )
        random_prompt = st.lists(ordinary, max_size=8)
    text_prompt = st.sampled_from(training_corpus()).flatmap(
        lambda line: st.integers(0, len(line)).map(lambda n: tokenizer.encode(line[:n], add_special_tokens=False))
    )
    sizes = st.lists(st.integers(1, 5), max_size=40)
    return st.tuples(st.one_of(text_prompt, random_prompt), output, sizes)


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "show_special"])
@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_deltas_concatenate_to_the_full_decode(request, name, skip):
    tok = request.getfixturevalue(name)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(detok_cases(tok, name))
    def check(case):
        prompt, output, sizes = case
        expected = reference(tok, prompt, output, skip)
        assume(expected is not None)
        assert "".join(stream(tok, prompt, split(output, sizes), skip)) == expected

    check()


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_real_text_token_by_token_never_emits_a_broken_character(request, name):
    tok = request.getfixturevalue(name)

    @settings(max_examples=60, deadline=None)
    @given(st.text(alphabet="ab é中文😀👍🏽🇫🇷한\n", max_size=30), st.sampled_from(training_corpus()))
    def check(text, prompt_text):
        prompt = tok.encode(prompt_text, add_special_tokens=False)
        output = tok.encode(text, add_special_tokens=False)
        deltas = stream(tok, prompt, [[i] for i in output])
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == reference(tok, prompt, output, True)

    check()


# ---------------------------------------------------------------- multi-byte characters


@pytest.mark.parametrize("char", ["😀", "中", "é", "한"])
def test_byte_level_character_split_over_tokens_is_emitted_once_complete(byte_level, char):
    pieces = byte_level_ids(byte_level, char.encode())
    prompt = byte_level.encode("Say:", add_special_tokens=False)
    tail = byte_level.encode("!", add_special_tokens=False)
    deltas = stream(byte_level, prompt, [[i] for i in pieces + tail])
    *held, complete, bang, flushed = deltas
    assert held == [""] * (len(pieces) - 1)
    assert (complete, bang, flushed) == (char, "!", "")


def test_sentencepiece_character_in_byte_tokens_is_emitted_once_complete(sentencepiece):
    tok = sentencepiece
    prompt = tok.encode("Hello", add_special_tokens=False)
    space = tok.convert_tokens_to_ids("▁")
    emoji = byte_fallback_ids(tok, "😀".encode())
    newline = byte_fallback_ids(tok, b"\n")
    deltas = stream(tok, prompt, [[i] for i in [space] + emoji + newline])
    assert deltas == [" ", "", "", "", "😀", "\n", ""]


def test_byte_fallback_run_that_turns_invalid_keeps_what_was_emitted(sentencepiece):
    """<0xE4><0xB8><0xAD> is "中"; a stray <0x80> after it makes the decoder print 4 x U+FFFD."""
    tok = sentencepiece
    prompt = tok.encode("Hi", add_special_tokens=False)
    output = byte_fallback_ids(tok, "中".encode() + b"\x80") + tok.encode(" ok", add_special_tokens=False)
    assert reference(tok, prompt, output, True) == "\ufffd" * 4 + " ok"
    deltas = stream(tok, prompt, [[i] for i in output])
    assert deltas[:4] == ["", "", "中", ""]
    assert "".join(deltas) == "中\ufffd ok"


def test_byte_fallback_output_cut_inside_a_character_keeps_the_run_before_it(sentencepiece):
    tok = sentencepiece
    prompt = tok.encode("Hi", add_special_tokens=False)
    output = byte_fallback_ids(tok, "こん".encode() + "に".encode()[:2])
    assert reference(tok, prompt, output, True) == "\ufffd" * 8
    assert "".join(stream(tok, prompt, [output])) == "こん\ufffd\ufffd"


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_flush_releases_an_unfinished_character_as_replacement(request, name):
    tok = request.getfixturevalue(name)
    to_ids = byte_level_ids if name == "byte_level" else byte_fallback_ids
    prompt = tok.encode("Hi there", add_special_tokens=False)
    output = tok.encode(" ok", add_special_tokens=False) + to_ids(tok, "😀".encode()[:2])
    deltas = stream(tok, prompt, [[i] for i in output])
    assert "\ufffd" not in "".join(deltas[:-1])
    assert "\ufffd" in deltas[-1]
    assert "".join(deltas) == reference(tok, prompt, output, True)


# ---------------------------------------------------------------- sentencepiece spacing


def test_sentencepiece_first_output_token_keeps_its_space_after_a_prompt(sentencepiece):
    tok = sentencepiece
    prompt = tok.encode("The quick brown fox", add_special_tokens=False)
    output = tok.encode(" jumps over", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(output[0]).startswith("▁")
    deltas = stream(tok, prompt, [[i] for i in output])
    assert deltas[0].startswith(" ")
    assert "".join(deltas) == " jumps over"


def test_sentencepiece_first_output_token_after_only_specials_is_the_start_of_text(sentencepiece):
    tok = sentencepiece
    bos = tok.convert_tokens_to_ids("<s>")
    output = tok.encode(" jumps", add_special_tokens=False)
    assert "".join(stream(tok, [bos], [output], skip=True)) == "jumps"
    assert "".join(stream(tok, [bos], [output], skip=False)) == " jumps"
    assert "".join(stream(tok, [], [output])) == "jumps"


def test_sentencepiece_prompt_ending_in_skipped_specials_still_spaces_the_first_token(sentencepiece):
    tok = sentencepiece
    prompt = tok.encode("Hello", add_special_tokens=False) + [tok.eos_token_id] * 7
    output = tok.encode(" world", add_special_tokens=False)
    assert "".join(stream(tok, prompt, [output], skip=True)) == " world" == reference(tok, prompt, output, True)


def test_context_does_not_start_inside_a_byte_run(sentencepiece):
    """The prompt's last 5 tokens start inside "文"; the output continues the same byte run."""
    tok = sentencepiece
    prompt = tok.encode("Hi 中文日", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(prompt[-5]) == "<0x96>"  # a continuation byte of "文"
    output = byte_fallback_ids(tok, "本".encode())
    assert "".join(stream(tok, prompt, [output])) == "本" == reference(tok, prompt, output, True)


def test_context_is_a_short_prompt_suffix_even_for_long_prompts(sentencepiece):
    tok = sentencepiece
    prompt = tok.encode(" ".join(training_corpus()), add_special_tokens=False)
    output = tok.encode(" and so it ends", add_special_tokens=False)
    assert len(prompt) > 1000
    assert "".join(stream(tok, prompt, [[i] for i in output])) == " and so it ends"


# ---------------------------------------------------------------- special tokens


def test_special_tokens_skipped_or_shown(byte_level):
    tok = byte_level
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    output = tok.encode("Hi", add_special_tokens=False) + [im_end] + tok.encode(" there", add_special_tokens=False)
    prompt = [eos] + tok.encode("Q:", add_special_tokens=False)
    assert "".join(stream(tok, prompt, [[i] for i in output], skip=True)) == "Hi there"
    assert "".join(stream(tok, prompt, [[i] for i in output], skip=False)) == "Hi<|im_end|> there"


def test_skipped_special_token_alone_emits_nothing(tokenizer):
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode("Hello world", add_special_tokens=False)
    assert stream(tokenizer, prompt, [[eos]], skip=True) == ["", ""]
    assert "".join(stream(tokenizer, prompt, [[eos]], skip=False)) == tokenizer.eos_token


# ---------------------------------------------------------------- chunking and long outputs


def test_chunked_and_token_by_token_give_the_same_text(tokenizer):
    prompt = tokenizer.encode("Mixed:", add_special_tokens=False)
    output = tokenizer.encode(MULTILINGUAL, add_special_tokens=False)
    one_by_one = "".join(stream(tokenizer, prompt, [[i] for i in output]))
    all_at_once = "".join(stream(tokenizer, prompt, [output]))
    assert one_by_one == all_at_once == reference(tokenizer, prompt, output, True)


def test_long_output_keeps_a_short_window(tokenizer):
    text = " ".join(training_corpus())
    output = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Go:", add_special_tokens=False))
    for token_id in output:
        detok.add_tokens([token_id])
        assert len(detok._ids) < 300  # emitted ids are dropped: the cost per token stays flat
    detok.flush()
    assert detok.output_text == reference(tokenizer, tokenizer.encode("Go:", add_special_tokens=False), output, True)
