"""Pipeline parallelism's split: which layers a stage holds and which ranks it talks to.

Ranks are numbered stage-major, as vLLM does: global rank = stage * tensor_parallel_size + tp_rank, so a stage's
tensor-parallel ranks are consecutive (one host's, when a host holds a whole stage) and rank 0 is stage 0's
tensor-parallel rank 0, the engine's process.

    stage 0: embedding, layers [0, k1), and (this project's choice) the final norm, LM head and sampler
    stage s: layers [k_s, k_s+1)
    last   : layers [k_P-1, L); sends its hidden states back to stage 0, which samples

Stage 0 samples so that everything a request's sampling keeps (penalties' history, grammars, seeds, logprobs)
stays in the engine's process beside the scheduler, and a tied LM head shares the embedding's memory.
"""

from __future__ import annotations

from dataclasses import dataclass


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Each stage's layers, as even as they divide; the layers left over go to the last stages (stage 0 also
    computes the embedding and the LM head)."""
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} pipeline stages for {num_layers} layers: a stage needs at least one layer")
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """Where one rank sits: its stage, the stage's layers, and its counterparts in the neighbouring stages
    (the rank with the same tensor-parallel rank: each holds the whole hidden state after its all-reduce)."""

    stage: int
    num_stages: int
    tp_size: int
    tp_rank: int
    layers: range

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, num_stages: int, num_layers: int) -> "PipelineStage":
        stage, tp_rank = divmod(rank, tp_size)
        return cls(stage, num_stages, tp_size, tp_rank, stage_layers(num_layers, num_stages)[stage])

    @classmethod
    def whole(cls, num_layers: int) -> "PipelineStage":
        """The one stage of a model that is not split."""
        return cls(0, 1, 1, 0, range(num_layers))

    @property
    def is_split(self) -> bool:
        return self.num_stages > 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def rank_of(self, stage: int) -> int:
        """The global rank of this rank's counterpart in `stage`."""
        return stage * self.tp_size + self.tp_rank

    @property
    def previous_rank(self) -> int:
        return self.rank_of(self.stage - 1)

    @property
    def next_rank(self) -> int:
        return self.rank_of(self.stage + 1)

    @property
    def first_rank(self) -> int:
        return self.rank_of(0)

    @property
    def last_rank(self) -> int:
        return self.rank_of(self.num_stages - 1)

    def describe(self) -> str:
        return f"stage {self.stage} of {self.num_stages}: layers {self.layers.start} .. {self.layers.stop - 1}"
