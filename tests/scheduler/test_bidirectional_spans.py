"""Bidirectional media spans (Gemma 3's images): a step computes a span whole or not at all, a prefix-cache hit
never ends inside one, and a span longer than a step's budget is refused at admission."""

from __future__ import annotations

from typing import Optional, Sequence

import pytest

from scheduler import MediaSpanTooLongError, Request, Scheduler
from scheduler.bidirectional_spans import chunk_length, hit_limit, longest_span
from tests.scheduler.factories import make_request, make_scheduler, run_until_done, step


def with_spans(
    request: Request, spans: Sequence[tuple[int, int]], key: bytes = b"image", bidirectional: bool = True
) -> Request:
    """`request` with media spans over `spans` (each keyed `key` and its index)."""
    request.media_spans = tuple((first, last, key + bytes([i])) for i, (first, last) in enumerate(spans))
    request.bidirectional_media = bidirectional
    return request


def chunks_of(scheduler: Scheduler, request: Request, max_steps: int = 200) -> list[tuple[int, int]]:
    """The (start, end) of every step of `request` until its prompt is computed."""
    chunks = []
    for _ in range(max_steps):
        if request.num_computed_tokens >= request.num_prompt_tokens:
            return chunks
        out, _ = step(scheduler)
        if request.request_id in out.num_scheduled_tokens:
            start = out.num_computed_tokens[request.request_id]
            chunks.append((start, start + out.num_scheduled_tokens[request.request_id]))
    raise AssertionError("the prompt was never computed")


def assert_never_cut(chunks: list[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> None:
    for start, end in chunks:
        for first, last in spans:
            assert not first < end < last and not first < start < last, (start, end, first, last)


def test_chunk_length():
    spans = [(5, 13), (16, 26)]
    assert chunk_length(spans, 0, 10, 10) == 5  # ends before the span it would cut
    assert chunk_length(spans, 5, 4, 10) == 8  # starts at a span: the span whole, past the wanted 4
    assert chunk_length(spans, 5, 4, 7) == 0  # ... or nothing when the budget cannot hold it
    assert chunk_length(spans, 5, 10, 10) == 10  # holds the first span whole, ends before the second
    assert chunk_length(spans, 13, 10, 10) == 3
    assert chunk_length(spans, 26, 10, 10) == 10
    assert chunk_length([], 3, 10, 10) == 10
    assert hit_limit(spans, 12, 4) == 4 and hit_limit(spans, 16, 4) == 16 and hit_limit(spans, 20, 4) == 16
    assert hit_limit(spans, 8, 4) == 4 and hit_limit(spans, 4, 4) == 4
    assert longest_span(spans) == 10 and longest_span([]) == 0


def test_chunks_end_outside_spans():
    s = make_scheduler(max_num_batched_tokens=10, block_size=4, num_blocks=32)
    spans = [(5, 13), (16, 26)]
    request = with_spans(make_request(30), spans)
    s.add_request(request)
    chunks = chunks_of(s, request)
    assert chunks == [(0, 5), (5, 15), (15, 16), (16, 26), (26, 30)]
    run_until_done(s)


def test_without_the_flag_chunks_cut_media_spans():
    s = make_scheduler(max_num_batched_tokens=10, block_size=4, num_blocks=32)
    request = with_spans(make_request(30), [(5, 13)], bidirectional=False)
    s.add_request(request)
    assert chunks_of(s, request)[0] == (0, 10)
    run_until_done(s)


def test_a_span_longer_than_the_chunk_cap_is_taken_whole():
    s = make_scheduler(max_num_batched_tokens=16, block_size=4, num_blocks=32, long_prefill_token_threshold=4)
    spans = [(2, 12)]
    request = with_spans(make_request(20), spans)
    s.add_request(request)
    chunks = chunks_of(s, request)
    assert (2, 12) in chunks
    assert_never_cut(chunks, spans)
    run_until_done(s)


def test_a_span_longer_than_a_step_is_refused():
    s = make_scheduler(max_num_batched_tokens=8, block_size=4, num_blocks=32)
    with pytest.raises(MediaSpanTooLongError, match="at least 9") as error:
        s.add_request(with_spans(make_request(20), [(3, 12)]))
    assert error.value.field == "prompt" and error.value.span_tokens == 9
    s.add_request(with_spans(make_request(20), [(3, 12)], bidirectional=False))  # (causal spans are chunked)
    s.add_request(with_spans(make_request(20), [(3, 11)]))
    run_until_done(s)


def test_a_span_waits_for_room_and_holds_admissions_back():
    """Decodes take their tokens first: a prompt whose next span does not fit what they leave waits, and no prompt
    is admitted meanwhile (it would become one more decode in the span's way)."""
    s = make_scheduler(max_num_batched_tokens=10, max_num_seqs=4, block_size=4, num_blocks=64)
    decoders = [make_request(2, max_tokens=3, first_token=500 + 10 * i) for i in range(2)]
    for decoder in decoders:
        s.add_request(decoder)
    step(s)  # their prompts
    spans = [(0, 10)]
    request = with_spans(make_request(14), spans)
    late = make_request(3, max_tokens=2, first_token=700)
    s.add_request(request)
    s.add_request(late)
    waited = False
    chunks = []
    while request.num_computed_tokens < request.num_prompt_tokens:
        out, _ = step(s)
        if request.request_id in out.num_scheduled_tokens:
            start = out.num_computed_tokens[request.request_id]
            chunks.append((start, start + out.num_scheduled_tokens[request.request_id]))
        elif not request.num_computed_tokens:
            waited = True
            assert late.request_id not in out.num_scheduled_tokens
    assert waited and chunks == [(0, 10), (10, 14)]
    run_until_done(s)


def test_a_prefix_hit_never_ends_inside_a_span():
    """The same prompt and image again: the hit (capped one token short of the prompt, here inside the image that
    ends the prompt) is cut back to the last block at or before the image's start."""
    s = make_scheduler(max_num_batched_tokens=32, block_size=4, num_blocks=32)
    spans = [(10, 20)]
    first = with_spans(make_request(20, max_tokens=1), spans)
    s.add_request(first)
    run_until_done(s)
    again = with_spans(make_request(20, max_tokens=1), spans)
    s.add_request(again)
    out, _ = step(s)
    assert out.num_computed_tokens[again.request_id] == 8
    assert out.num_scheduled_tokens[again.request_id] == 12
    other = with_spans(make_request(20, max_tokens=1), spans, key=b"other")
    s.add_request(other)
    out, _ = step(s)
    assert out.num_computed_tokens[other.request_id] == 8  # its blocks before the image only
    run_until_done(s)


def test_a_prefix_hit_inside_a_span_in_a_sliding_group():
    """Sliding and full groups: the hit is cut back inside the search for the largest hit every window serves."""
    s = make_scheduler(max_num_batched_tokens=32, block_size=4, num_blocks=64, kv_group_windows=(None, 6))
    spans = [(9, 19)]
    first = with_spans(make_request(24, max_tokens=1), spans)
    s.add_request(first)
    run_until_done(s)
    again = with_spans(make_request(26, max_tokens=1), spans)  # (a longer prompt: the hit is not capped)
    s.add_request(again)
    out, _ = step(s)
    assert out.num_computed_tokens[again.request_id] == 24
    partial = with_spans(make_request(26, max_tokens=1), [(9, 25)])  # the same tokens, its image past the hit
    s.add_request(partial)
    out, _ = step(s)
    assert out.num_computed_tokens[partial.request_id] in (0, 8)
    run_until_done(s)


def _preempting_scheduler(window: Optional[int]) -> Scheduler:
    windows = (None,) if window is None else (None, window)
    return make_scheduler(
        max_num_batched_tokens=12, max_num_seqs=4, block_size=4, num_blocks=14, kv_group_windows=windows
    )


@pytest.mark.parametrize("window", [None, 6])
def test_preempted_requests_resume_outside_their_spans(window):
    s = _preempting_scheduler(window)
    spans = [(3, 11)]
    requests = [with_spans(make_request(16, max_tokens=12, first_token=100 + 50 * i), spans) for i in range(3)]
    for request in requests:
        s.add_request(request)
    for out in run_until_done(s):
        for request_id, start in out.num_computed_tokens.items():
            end = start + out.num_scheduled_tokens[request_id]
            assert not 3 < start < 11 and not 3 < end < 11, (request_id, start, end)
    assert s.stats().num_preemptions > 0
