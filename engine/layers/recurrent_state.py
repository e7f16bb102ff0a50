"""The recurrent state of a hybrid model's recurrent layers: per request, a convolution window and (Mamba-2) an SSM
state.

An attention layer keeps every past token's K/V in blocks (engine/attention/kv_cache.py); a recurrent layer keeps a
fixed-size summary instead, whatever the sequence's length: the last `kernel - 1` inputs of its causal
convolution, and a Mamba-2 layer the [heads, head_dim, d_state] state of its scan (LFM2's short convolutions keep
the window alone). Each request owns one row of these tensors, the
row of the runner's block table it already holds (engine/runner/block_table.py: at most `max_num_seqs`), so a
worker process that follows the step messages holds the same rows. A row is zeroed by the step that computes its
request's first token (a new request, a resumed one that recomputes, or a row handed to another request), and
every later step of the request reads it and writes it back.

A state summarises the whole prefix, so cached K/V blocks alone cannot restore it: the rows after the requests'
hold snapshots of states at block boundaries (scheduler/state_snapshots.py says which), which a prefix-cache hit
copies into the request's row. A snapshot inside a step's prompt chunk is taken by each layer as its scan reaches
it (`RecurrentStep.prefills` ends a piece there). A rejected draft token cannot be taken back out of a state:
hybrid models run without speculative decoding (engine/shard_builder.py says so at start-up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Sequence

import torch


DECODE_ROWS = 32
"""Decoding requests whose states one slice of a step's decodes reads and writes at once."""


@dataclass(frozen=True, slots=True)
class StateShape:
    """What one recurrent layer keeps per request: a convolution window of `conv_dim` channels and `conv_kernel - 1`
    positions, and an SSM state of `ssm` (() none)."""

    conv_dim: int
    conv_kernel: int
    ssm: tuple[int, ...] = ()

    def bytes_per_row(self, num_layers: int, dtype: torch.dtype) -> int:
        """What one request's state takes over `num_layers` such layers (the window in `dtype`, the SSM in
        float32)."""
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
        ssm = 4 * math.prod(self.ssm) if self.ssm else 0
        return num_layers * (conv + ssm)


@dataclass(frozen=True, slots=True)
class MambaShape:
    """One Mamba-2 layer's sizes, as HF's configs name them (mamba_n_heads, mamba_d_head, mamba_d_state, ...)."""

    num_heads: int
    head_dim: int
    state_size: int  # d_state: N
    num_groups: int  # B and C are shared by num_heads / num_groups heads each
    conv_kernel: int  # d_conv
    intermediate_size: int  # num_heads * head_dim
    chunk_size: int  # the scan's chunk over a prompt
    time_step_limit: tuple[float, float]
    norm_eps: float
    # >1: one rank's share under tensor parallelism whose gated norm's group spans this many ranks (one group of B
    # and C, replicated on every rank: its mean square all-reduced)
    norm_ranks: int = 1

    @property
    def conv_dim(self) -> int:
        """The convolved channels: x, B and C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def state(self) -> StateShape:
        return StateShape(self.conv_dim, self.conv_kernel, (self.num_heads, self.head_dim, self.state_size))


@dataclass(frozen=True, slots=True)
class RecurrentStep:
    """The requests of one step as a recurrent layer reads them: decodes (one token each) first, in batch order.

    Request i's tokens are rows `query_start_loc[i] .. query_start_loc[i + 1] - 1` of the step, and its state is
    row `rows[i]` of every layer's state tensors (`rows_cpu[i]` on the host)."""

    states: "RecurrentStates"
    rows: torch.Tensor  # [num_reqs] int64, on the states' device
    rows_cpu: tuple[int, ...]
    query_start_loc_cpu: tuple[int, ...]  # [num_reqs + 1]
    num_decodes: int
    # request i -> (offset, row) of the snapshots taken inside its chunk: its state after its first `offset` tokens
    # of the step is copied to `row`
    splits: Mapping[int, Sequence[tuple[int, int]]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.rows_cpu)

    def decode_slices(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(first, end, their state rows) of the step's decodes, DECODE_ROWS at a time: a decode reads each request's
        whole state out and writes it back, so a slice bounds the step's temporaries (which the start-up memory
        profile does not see)."""
        for first in range(0, self.num_decodes, DECODE_ROWS):
            end = min(first + DECODE_ROWS, self.num_decodes)
            yield first, end, self.rows[first:end]

    def prefills(self, layer: int) -> Iterator[tuple[int, int, int]]:
        """(first, end, its state row) of each request computing a prompt chunk (its tokens first .. end - 1), in
        pieces where the chunk holds snapshots: recurrent layer `layer`'s state is copied out after each piece that
        ends at one (before the next piece is asked for)."""
        starts, splits = self.query_start_loc_cpu, self.splits
        for i in range(self.num_decodes, self.num_reqs):
            first, row = starts[i], self.rows_cpu[i]
            for offset, target in splits.get(i, ()):
                yield first, starts[i] + offset, row
                self.states.copy_layer(layer, row, target)
                first = starts[i] + offset
            yield first, starts[i + 1], row


def lone_sequence(shape: StateShape, num_tokens: int, dtype: torch.dtype, device: torch.device) -> RecurrentStep:
    """A step of one request's first `num_tokens` tokens over a state of its own, kept nowhere: what a recurrent layer
    computes in a forward pass no runner set a step for (a profiling pass)."""
    states = RecurrentStates(shape, 1, 1, dtype, device)
    return states.step([0], [0, num_tokens], [num_tokens], 0)


class RecurrentStates:
    """Per recurrent layer, the conv windows `[rows, conv_dim, kernel - 1]` (the model's dtype: they are inputs the
    layer computed) and the SSM states `[rows, *ssm]` (Mamba-2's [heads, head_dim, d_state], float32: the scan adds
    into them every token, as HF's reference scan computes in float32; `[rows, 0]` for a layer without one). The
    requests' `rows` come first, then `snapshots` rows (snapshot slot k: row `rows + k`)."""

    def __init__(
        self,
        shape: StateShape,
        num_layers: int,
        rows: int,
        dtype: torch.dtype,
        device: torch.device,
        snapshots: int = 0,
    ):
        self.shape = shape
        self.rows = rows
        self.snapshots = snapshots
        total = rows + snapshots
        self.conv = torch.zeros((num_layers, total, shape.conv_dim, shape.conv_kernel - 1), dtype=dtype, device=device)
        self.ssm = torch.zeros((num_layers, total, *(shape.ssm or (0,))), dtype=torch.float32, device=device)

    def snapshot_row(self, slot: int) -> int:
        if not 0 <= slot < self.snapshots:
            raise IndexError(f"snapshot slot {slot} of {self.snapshots}")
        return self.rows + slot

    def copy_rows(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Every layer's state of row `sources[i]` into row `targets[i]` (a snapshot taken, or restored): row by
        row, with no temporary (a gather of several rows would hold them all at once, unseen by the memory
        profile)."""
        conv, ssm = self.conv, self.ssm
        for source, target in zip(sources, targets, strict=True):
            conv[:, target].copy_(conv[:, source])
            ssm[:, target].copy_(ssm[:, source])

    def copy_layer(self, layer: int, source: int, target: int) -> None:
        """Layer `layer`'s state of row `source` into row `target`."""
        self.conv[layer, target] = self.conv[layer, source]
        self.ssm[layer, target] = self.ssm[layer, source]

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    def step(
        self,
        rows: Sequence[int],
        query_start_loc: Sequence[int],
        seq_lens: Sequence[int],
        num_decodes: int,
        splits: Optional[Mapping[int, Sequence[tuple[int, int]]]] = None,
    ) -> RecurrentStep:
        """The step of requests on `rows` (batch order, decodes first) computing tokens up to `seq_lens`, with
        snapshots inside their chunks (`splits`: RecurrentStep's); the rows of requests whose first token the step
        computes are zeroed here, before any layer reads them."""
        rows_cpu, starts = tuple(rows), tuple(query_start_loc)
        fresh = [
            row
            for i, row in enumerate(rows_cpu)
            if seq_lens[i] == starts[i + 1] - starts[i]  # (no token of it computed before this step)
        ]
        if fresh:
            index = torch.tensor(fresh, dtype=torch.int64, device=self.conv.device)
            self.conv[:, index] = 0
            self.ssm[:, index] = 0
        index = torch.tensor(rows_cpu, dtype=torch.int64, device=self.conv.device)
        return RecurrentStep(self, index, rows_cpu, starts, num_decodes, dict(splits or {}))

    def release(self) -> None:
        """Drop the tensors (the engine is shutting down)."""
        self.conv = self.ssm = torch.empty(0)
