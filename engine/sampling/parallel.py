"""`n > 1`: one engine request per choice, sharing the prompt's cached blocks."""

from __future__ import annotations

from engine.sampling.params import SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """(child id, child params) for each of the `n` choices; `n == 1` keeps the id.

    The children are added together, so the first one's full prompt blocks are in
    the prefix cache when the others are admitted and are shared, not recomputed.
    """
    if params.n == 1:
        return [(request_id, params)]
    return [(child_request_id(request_id, i), params.for_child(i)) for i in range(params.n)]
