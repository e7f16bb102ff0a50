"""The runner's side of pooling: which rows of a prompt chunk a request pools, their sum carried across chunks,
and the finished vector (mean taken, Matryoshka-truncated, normalized)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from engine.pooling.params import Pooling, PoolingType


def rows_to_pool(pooling: Pooling, start: int, num_tokens: int, num_prompt_tokens: int) -> tuple[int, int]:
    """(first row within the chunk, count) of the chunk's rows the request pools (count 0: none). The chunk
    computes prompt positions [start, start + num_tokens)."""
    if pooling.type is PoolingType.MEAN:
        return 0, num_tokens
    if pooling.type is PoolingType.CLS:
        return 0, int(start == 0)
    return num_tokens - 1, int(start + num_tokens == num_prompt_tokens)


def add_rows(held: Optional[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """The running sum over pooled rows: `rows` [n, hidden] (final-normed) added in float32 -> [hidden]."""
    total = rows.float().sum(dim=0)
    return total if held is None else held + total


def finish(total: torch.Tensor, pooling: Pooling, num_prompt_tokens: int) -> torch.Tensor:
    """The request's embedding [dimensions or hidden] in float32 on the CPU, from the sum of its pooled rows:
    the mean for MEAN, then its first `dimensions` components, then scaled to unit length if it normalizes
    (truncation first: a Matryoshka model's shorter embedding is normalized at its own length)."""
    vector = total / num_prompt_tokens if pooling.type is PoolingType.MEAN else total
    if pooling.dimensions is not None:
        vector = vector[: pooling.dimensions]
    if pooling.normalize:
        vector = F.normalize(vector, p=2.0, dim=-1)
    return vector.to("cpu")
