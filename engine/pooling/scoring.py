"""Scoring text pairs (vLLM's `score`, and reranking): which pairs a call asks for, and an embedding model's score
of a pair, the cosine of its two vectors."""

from __future__ import annotations

import math
from typing import Sequence, Union

from engine.errors import InvalidParameterError


def pair_up(first: Union[str, Sequence[str]], second: Union[str, Sequence[str]]) -> list[tuple[str, str]]:
    """vLLM's pairing: one first text against each second one, or the two lists pairwise (then of one length)."""
    firsts = [first] if isinstance(first, str) else list(first)
    seconds = [second] if isinstance(second, str) else list(second)
    if not firsts or not seconds:
        raise InvalidParameterError("text_1" if not firsts else "text_2", "must not be empty")
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise InvalidParameterError(
            "text_2", f"has {len(seconds)} texts for {len(firsts)} text_1: give one text_1, or as many as text_2"
        )
    return [(firsts[0] if len(firsts) == 1 else firsts[i], text) for i, text in enumerate(seconds)]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors (0 for a zero vector), in double precision."""
    dot = math.fsum(x * y for x, y in zip(a, b))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms else 0.0
