"""StopStringMatcher: stop strings found across deltas, held-back prefixes, OpenAI/vLLM cut semantics."""

from __future__ import annotations

from typing import Optional, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.stop_strings import StopMatch, StopStringMatcher
from tests.engine.tokenizers_for_tests import byte_level_ids, make_byte_level_tokenizer


def run(stop: Sequence[str], deltas: Sequence[str], include: bool = False) -> tuple[list[str], Optional[str]]:
    """Emitted pieces (with flush() when no stop was hit) and the stop string hit."""
    matcher = StopStringMatcher(stop, include_stop_str_in_output=include)
    emitted = []
    for delta in deltas:
        match = matcher.add_text(delta)
        emitted.append(match.text)
        if match.stop is not None:
            return emitted, match.stop
    emitted.append(matcher.flush())
    return emitted, None


def reference(text: str, stop: Sequence[str], include: bool) -> tuple[str, Optional[str]]:
    """Brute force: the first moment (end position) any stop string is complete; longest on a tie."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop if text.endswith(s, 0, end)]
        if done:
            hit = max(done, key=len)
            return text[: end if include else end - len(hit)], hit
    return text, None


def split(text: str, cuts: Sequence[int]) -> list[str]:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------- concrete cases


def test_stop_string_split_across_deltas():
    emitted, stop = run(["STOP"], ["Hello S", "T", "OP and more"])
    assert emitted == ["Hello ", "", ""]
    assert stop == "STOP"


def test_stop_string_in_one_delta_cuts_the_rest():
    assert run(["\n\n"], ["a\n\nb"]) == (["a"], "\n\n")


def test_include_stop_str_in_output():
    assert run(["STOP"], ["Hello S", "TOP and more"], include=True) == (["Hello ", "STOP"], "STOP")


def test_earliest_stop_wins_over_list_order():
    assert run(["world", "lo"], ["hello world"]) == (["hel"], "lo")


def test_stop_completed_first_wins_over_one_starting_earlier():
    """ "abcd" starts first but "bc" is complete one character earlier: generation ends there."""
    assert run(["abcd", "bc"], ["x", "abcd"]) == (["x", "a"], "bc")
    assert run(["abcd", "bc"], ["xa", "b", "c", "d"]) == (["x", "", "a"], "bc")


def test_longest_of_stops_ending_together_wins():
    assert run(["c", "abc"], ["xab", "c"], include=True) == (["x", "abc"], "abc")


def test_stop_string_at_the_very_start():
    assert run(["<end>"], ["<e", "nd>", "more"]) == (["", ""], "<end>")


def test_held_back_text_is_released_on_flush():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.add_text("42 </ans") == StopMatch("42 ")
    assert matcher.held_text == "</ans"
    assert matcher.flush() == "</ans"
    assert matcher.held_text == ""


def test_partial_prefix_that_is_not_a_stop_is_emitted():
    emitted, stop = run(["###"], ["Title ##", " sub", "heading"])
    assert emitted == ["Title ", "## sub", "heading", ""]
    assert stop is None


def test_overlapping_prefix_keeps_holding_the_right_suffix():
    """ "aab" after "aa...": the held suffix shifts by one instead of being released whole."""
    matcher = StopStringMatcher(["aab"])
    assert matcher.add_text("aa") == StopMatch("")
    assert matcher.add_text("a") == StopMatch("a")
    assert matcher.add_text("b") == StopMatch("", "aab")


def test_nothing_is_emitted_after_a_stop():
    matcher = StopStringMatcher(["x"])
    assert matcher.add_text("abxcd") == StopMatch("ab", "x")
    assert matcher.stopped
    assert matcher.add_text("more x") == StopMatch()
    assert matcher.flush() == ""


def test_no_stop_strings_passes_text_through():
    assert run([], ["a", "b"]) == (["a", "b", ""], None)


def test_unicode_stop_string():
    assert run(["。"], ["你好", "。再见"]) == (["你好", ""], "。")


@pytest.mark.parametrize("stop", [[""], "STOP"])
def test_bad_stop_arguments_are_rejected(stop):
    with pytest.raises((ValueError, TypeError)):
        StopStringMatcher(stop)


def test_stop_string_over_detokenized_multibyte_tokens():
    """A stop string whose characters span several byte-level tokens, fed token by token."""
    tok = make_byte_level_tokenizer()
    prompt = tok.encode("Q:", add_special_tokens=False)
    output = tok.encode("ok ", add_special_tokens=False) + byte_level_ids(tok, "😀🎉 tail".encode())
    detok = IncrementalDetokenizer(tok, prompt)
    matcher = StopStringMatcher(["😀🎉"])
    emitted, stop = [], None
    for token_id in output:
        match = matcher.add_text(detok.add_tokens([token_id]))
        emitted.append(match.text)
        if match.stop is not None:
            stop = match.stop
            break
    assert ("".join(emitted), stop) == ("ok ", "😀🎉")


# ---------------------------------------------------------------- property


ALPHABET = "ab\n😀"
stop_sets = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=4)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stop=stop_sets,
    cuts=st.lists(st.integers(0, 40), max_size=12),
    include=st.booleans(),
)
def test_emitted_text_is_the_text_cut_at_the_first_stop(text, stop, cuts, include):
    matcher = StopStringMatcher(stop, include_stop_str_in_output=include)
    received, emitted, hit = "", "", None
    for delta in split(text, cuts):
        received += delta
        match = matcher.add_text(delta)
        emitted += match.text
        if match.stop is not None:
            hit = match.stop
            break
        held = matcher.held_text
        assert emitted + held == received
        assert held == "" or any(s.startswith(held) and s != held for s in stop)
    if hit is None:
        emitted += matcher.flush()
    assert (emitted, hit) == reference(text, stop, include)
