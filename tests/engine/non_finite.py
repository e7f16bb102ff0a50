"""A model's overflow as the attention kernels' tests plant it: one NaN or infinity in the query, a key or a value
of kv head 1 (query heads 3-5), dim 5 (the decode and the prefill tests check the output is NaN where float64's
is)."""

from __future__ import annotations

import torch


def plant_non_finite(case: str, query, key_cache, value_cache, block, slot: int, nan_row, inf_rows) -> None:
    """query_nan: query[nan_row] head 4 dim 3; key_nan / key_inf / value_nan: the cache's (block, slot) row of kv
    head 1 at dim 5, key_inf with query heads 3 and 4 made +1 and -1 there (scores +inf and -inf) in inf_rows."""
    if case == "query_nan":
        query[nan_row, 4, 3] = torch.nan
    elif case == "key_nan":
        key_cache[block, slot, 1, 5] = torch.nan
    elif case == "key_inf":
        key_cache[block, slot, 1, 5] = torch.inf
        query[inf_rows, 3, 5], query[inf_rows, 4, 5] = 1.0, -1.0
    elif case == "value_nan":
        value_cache[block, slot, 1, 5] = torch.nan
    else:
        raise ValueError(case)
