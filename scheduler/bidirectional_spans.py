"""Where a step may cut a prompt that holds bidirectional spans.

Some vision-language models (Gemma 3) let the tokens of one image attend to each other both ways during the
prompt, while everything else stays causal. A paged server can compute that only when every query and key of
the span are in the same step (the later keys of a span are not in the cache when an earlier step attends), so:

    prompt     t t t [i i i i i i] t t [i i i i] t
    chunks     t t t|i i i i i i t t|i i i i t         a chunk ends before a span or after it, never inside
    hits       block-aligned, and never ending inside a span (rounded down to a block at or before its start)

A request's spans are pure data here: (start, end) position pairs, end exclusive, sorted, not overlapping.
"""

from __future__ import annotations

from typing import Sequence

Span = tuple[int, int]


def chunk_length(spans: Sequence[Span], start: int, num_tokens: int, budget: int) -> int:
    """How many tokens a chunk from position `start` computes, `num_tokens` wanted (already within the step's
    budget and the chunk cap): cut short before a span it would end inside; a span that starts at (or holds)
    `start` taken whole when `budget` holds it (past the cap, which is a fairness limit, not a shape one), else
    0: the request waits for a step with room for the span."""
    end = start + num_tokens
    for first, last in spans:
        if first < end < last:  # (at most one span holds the end)
            if first > start:
                return first - start
            return last - start if last - start <= budget else 0
    return num_tokens


def hit_limit(spans: Sequence[Span], num_tokens: int, block_size: int) -> int:
    """The longest prefix-cache hit of at most `num_tokens` (a multiple of `block_size`) that ends inside no span:
    one ending inside is cut back to the last block boundary at or before the span's start."""
    for first, last in spans:
        if first < num_tokens < last:
            return first // block_size * block_size
    return num_tokens


def longest_span(spans: Sequence[Span]) -> int:
    """The most tokens one step must compute for a span (0 without spans)."""
    return max((last - first for first, last in spans), default=0)
