"""Expert parallelism (`--enable-expert-parallel`, vLLM's flag): the ranks of a tensor-parallel group share out a
mixture's routed experts, each expert whole on one rank, instead of each rank holding its share of every expert's
width (models/tensor_parallel.py).

    E experts, N ranks     rank r holds experts [first_r, first_r + count_r): E // N each, the first E % N ranks
                           one more (vLLM's linear placement)
    router                 replicated: every rank routes every token over the E experts alike
    rank r's block         the (token, expert) pairs of its own experts only (layers/moe.py, `first_expert`)
    the sum                the layer's all-reduce, which sums the width-cut experts' partial outputs too: each
                           pair's output comes from one rank, the others add zeros
    shared experts         cut by width as under tensor parallelism (every token goes through them)
    attention, dense MLPs  cut as under tensor parallelism

A rank reads E / N whole experts instead of 1 / N of each: an expert's products keep their width (Qwen3-30B-A3B's
768 over 8 ranks would be 96 rows each), no width is padded, and experts stored in any format are taken whole,
GGUF blocks included. A token's experts may all sit on one rank, so the ranks' work per step is as even as the
routing.
"""

from __future__ import annotations

from engine.errors import SettingsConflictError


def held_experts(num_experts: int, rank: int, ranks: int) -> range:
    """The experts rank `rank` of `ranks` holds (vLLM's linear placement)."""
    if num_experts < ranks:
        raise SettingsConflictError(
            f"--enable-expert-parallel: the model's {num_experts} experts are fewer than the {ranks} ranks"
        )
    base, extra = divmod(num_experts, ranks)
    first = rank * base + min(rank, extra)
    return range(first, first + base + (rank < extra))


def describe_placement(num_experts: int, ranks: int) -> str:
    """The start-up log's line."""
    spans = [held_experts(num_experts, rank, ranks) for rank in range(ranks)]
    held = [f"{span.start}" if len(span) == 1 else f"{span.start}..{span.stop - 1}" for span in spans]
    return f"expert parallel: {num_experts} experts over {ranks} ranks, " + ", ".join(
        f"rank {rank} {experts}" for rank, experts in enumerate(held)
    )
