"""Expert parallelism's placement (engine/models/expert_parallel.py): each expert on exactly one rank, the first
E mod N ranks one more (vLLM's linear placement); fewer experts than ranks refused."""

from __future__ import annotations

import pytest

from engine.errors import SettingsConflictError
from engine.models.expert_parallel import describe_placement, held_experts


@pytest.mark.parametrize(
    "experts, ranks, counts", [(8, 2, [4, 4]), (6, 4, [2, 2, 1, 1]), (5, 2, [3, 2]), (4, 4, [1] * 4)]
)
def test_each_expert_is_held_by_one_rank(experts, ranks, counts):
    spans = [held_experts(experts, rank, ranks) for rank in range(ranks)]
    assert [len(span) for span in spans] == counts
    assert [e for span in spans for e in span] == list(range(experts))


def test_fewer_experts_than_ranks_are_refused():
    with pytest.raises(SettingsConflictError, match="the model's 3 experts are fewer than the 4 ranks"):
        held_experts(3, 0, 4)


def test_the_start_up_line_names_each_ranks_experts():
    assert (
        describe_placement(6, 4)
        == "expert parallel: 6 experts over 4 ranks, rank 0 0..1, rank 1 2..3, rank 2 4, rank 3 5"
    )
