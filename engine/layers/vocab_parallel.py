"""The vocabulary split over tensor-parallel ranks (Megatron's VocabParallelEmbedding and parallel LM head): rank r
holds rows [r * rows, (r + 1) * rows) of the embedding and of the LM head, the vocabulary padded with zero rows to
a multiple of the ranks.

    vocab 511, 2 ranks:  rows = 256   rank 0: ids 0 .. 255   rank 1: ids 256 .. 510 + one zero row (padding)

    embedding   each rank looks up the ids in its range, zeros for the others; the all-reduce sums the one
                non-zero row of every token (x + 0 is exact: the rows are the whole model's, bit for bit)
    logits      each rank's [n, rows] slice of the same rows; an all-gather puts them side by side and the
                padding columns are cut off, so every rank holds [n, vocab] as one process computes it (no -inf
                masking is needed: the padding never reaches the sampler)

Every rank must embed and compute logits for the same rows in the same order: the collectives pair up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.quantization.gguf_weight import GgufWeight


@dataclass(frozen=True, slots=True)
class VocabParallel:
    """Rank `tp.rank`'s slice of a `vocab_size` vocabulary: ids `start` .. `start + rows - 1` (the last rank's
    range may run past the vocabulary into the padding)."""

    vocab_size: int
    tp: ParallelGroup

    @property
    def rows(self) -> int:
        return -(-self.vocab_size // self.tp.world_size)

    @property
    def start(self) -> int:
        return self.tp.rank * self.rows

    def shard(self, weight: Union[torch.Tensor, GgufWeight]) -> Union[torch.Tensor, GgufWeight]:
        """This rank's rows of a whole [vocab, hidden] embedding or LM head, zero rows past the vocabulary (a GGUF
        one keeps its blocks: whole rows of them are exact)."""
        total = weight.out_features if isinstance(weight, GgufWeight) else weight.shape[0]
        if total != self.vocab_size:
            raise ValueError(f"a vocabulary matrix of {total} rows for a vocabulary of {self.vocab_size}")
        if isinstance(weight, GgufWeight):
            mine = weight.take_rows(torch.arange(self.start, min(self.start + self.rows, self.vocab_size)))
            if mine.out_features == self.rows:
                return mine
            return GgufWeight.concat_rows([mine, mine.zero_rows(self.rows - mine.out_features)])
        own = weight[self.start : self.start + self.rows]
        if own.shape[0] == self.rows:
            return own.contiguous()
        padding = weight.new_zeros((self.rows - own.shape[0], *weight.shape[1:]))
        return torch.cat([own, padding])

    def embed(self, input_ids: torch.Tensor, lookup: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]: `lookup` (of this rank's rows) for the ids in its range, all-reduced."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)  # [T]
        hidden = lookup(local.masked_fill(outside, 0))  # [T, hidden]
        hidden.masked_fill_(outside.unsqueeze(1), 0)
        return self.tp.all_reduce(hidden)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """local [n, rows] (this rank's columns) -> [n, vocab], every rank's columns in order."""
        parts = self.tp.all_gather(local)  # [ranks, n, rows]
        logits = parts.transpose(0, 1).reshape(local.shape[0], -1)  # [n, ranks * rows]
        return logits[:, : self.vocab_size].contiguous()
