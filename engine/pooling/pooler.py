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


def finish(
    total: torch.Tensor, pooling: Pooling, num_prompt_tokens: int, classifier: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The request's output in float32 on the CPU, from the sum of its pooled rows: the mean for MEAN; then for
    a classification model its class scores (`classifier` [num_labels, hidden] over the vector, through its
    activation); else its embedding [dimensions or hidden]: the first `dimensions` components, scaled to unit
    length if it normalizes (truncation first: a Matryoshka model's shorter embedding is normalized at its own
    length)."""
    vector = total / num_prompt_tokens if pooling.type is PoolingType.MEAN else total
    if pooling.classify:
        assert classifier is not None, "a classification request reached a model without a classifier"
        logits = classifier.float() @ vector  # [num_labels]
        if pooling.activation == "softmax":
            logits = torch.softmax(logits, dim=-1)
        elif pooling.activation == "sigmoid":
            logits = torch.sigmoid(logits)
        return logits.to("cpu")
    if pooling.dimensions is not None:
        vector = vector[: pooling.dimensions]
    if pooling.normalize:
        vector = F.normalize(vector, p=2.0, dim=-1)
    return vector.to("cpu")
