"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up, replayed per step.

A decode step of B requests runs the graph of the smallest bucket >= B. The graph reads
the runner's persistent step buffers in place (StepBuffers: input ids, positions, slot
mapping, query start offsets, sequence lengths, block table), so a step only writes its
inputs into them and replays. Rows B .. bucket - 1 are padding: token 0 at position 0,
writing its K/V into the cache's padding block (KVCache.pad_block, which the scheduler
never hands out), attending to that one token. Their outputs are ignored.

What is fixed in a graph, and so the same for every step of its bucket:
  - the number of rows (the bucket), and the block table's width (`max_blocks_per_req`:
    every request's row is read as if it were as long as `max_model_len`; kernels stop
    at each request's `seq_lens`, as the Triton decode kernel and flash-attn do);
  - `max_seq_len` (= max_model_len) and `max_query_len` (= 1), the host ints a backend
    may size its grid from;
  - the backend's metadata built from those views (captured with the forward pass).
Backends whose metadata reads host values to shape the step (the torch and cpu
backends walk requests in Python) say `cuda_graphs = False` and always run eagerly.

Prefill and mixed steps, and decode batches larger than the largest bucket, run eagerly.
The graphs share one memory pool, captured largest first so smaller ones reuse its blocks;
their memory is measured before the KV cache is sized (engine/builder.py).

With LoRA each graph is captured with its own static per-token LoRA inputs (engine/lora/lora_graph_inputs.py),
filled before each replay: steps with adapters replay too, and base-only steps replay the same graph with no
slot for any row (a zero delta).

Off CUDA there is nothing to capture; `EagerReplay` runs the same padded step through the
same buffers each time, which is how the padding and bucketing are tested on CPU.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np
import torch

from engine.attention import AttentionBackend
from engine.attention.step_metadata import StepMetadata
from engine.attention.kv_cache import KVCache
from engine.attention.local_chunks import local_chunks
from engine.layers.mrope import SectionedRows
from engine.lora.lora_graph_inputs import LoRAGraphInputs
from engine.lora.lora_stack import LoRAStack
from engine.lora.lora_step import LoRASegment, LoRAStep
from engine.runner.step_buffers import StepBuffers

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8)
"""Bucket sizes below the regular steps (a small batch padded to 8 would waste most of a step)."""


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then steps of 8 up to 256 and of 16 beyond, and
    `max_num_seqs` itself (so every decode batch the scheduler can form has one)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [size for size in SMALL_BUCKETS if size <= max_num_seqs]
    size = 16
    while size <= max_num_seqs:
        sizes.append(size)
        size += 8 if size < 256 else 16
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return tuple(sizes)


def bucket_for(buckets: tuple[int, ...], num_reqs: int) -> Optional[int]:
    """The smallest bucket holding `num_reqs` rows (None: larger than every bucket, or empty)."""
    if num_reqs < 1:
        return None
    index = bisect.bisect_left(buckets, num_reqs)
    return buckets[index] if index < len(buckets) else None


class Graph(Protocol):
    def replay(self) -> torch.Tensor:
        """Run the captured step; returns its output tensor ([bucket, hidden])."""
        ...

    def release(self) -> None:
        """Free the graph and its output (it is not replayed again)."""
        ...


class CudaGraph:
    """A captured CUDA graph and its static output."""

    def __init__(self, forward: Callable[[], torch.Tensor], pool, stream: torch.cuda.Stream):
        self.graph = torch.cuda.CUDAGraph()
        self.output: Optional[torch.Tensor]  # None once released
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.output = forward()

    def replay(self) -> torch.Tensor:
        assert self.output is not None  # not released (a released graph is not replayed)
        self.graph.replay()
        return self.output

    def release(self) -> None:
        self.graph.reset()
        self.output = None


class EagerReplay:
    """The same padded step run eagerly at each replay (off CUDA: tests of padding and bucketing; any
    backend, since its metadata is built again at every replay)."""

    def __init__(self, forward: Callable[[], torch.Tensor], pool=None, stream=None):
        self.forward: Optional[Callable[[], torch.Tensor]] = forward  # None once released
        self.replays = 0

    def replay(self) -> torch.Tensor:
        assert self.forward is not None  # not released (a released graph is not replayed)
        self.replays += 1
        return self.forward()

    def release(self) -> None:
        self.forward = None


ForwardFn = Callable[..., torch.Tensor]
"""(input_ids, positions, steps[, hidden_states][, lora_step=][, sectioned=]) -> hidden states: `model_forward`'s."""
"""(input_ids, positions, the step per KV layer group) -> hidden states: the model's forward pass over the KV
cache."""


def model_forward(model, backend: AttentionBackend, kv_cache: KVCache) -> ForwardFn:
    """The model's forward pass over `kv_cache` through `backend`: what a step runs and a decode graph
    captures. A closure over the three parts, not a method of the runner: the graphs keep it, and a
    runner <-> graphs cycle would outlive the last reference to the engine. The step comes as one
    StepMetadata per KV layer group; each layer attends with its group's metadata, a layer with chunked local
    attention with its group's step cut at its chunks' boundaries (attention/local_chunks.py)."""
    group_of_layer = kv_cache.spec.group_of_layer
    block_size = kv_cache.spec.block_size
    # (group, chunk) of each layer; chunk None: the group's step as it is
    layer_keys = [
        (group, attention.chunk) for group, attention in zip(group_of_layer, model.attention_layers, strict=True)
    ]

    def forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        steps: Sequence[StepMetadata],
        hidden_states: Optional[torch.Tensor] = None,  # a pipeline stage's input, after the first stage
        lora_step: Optional[LoRAStep] = None,  # a decode graph's own LoRA inputs (else the runner's, if any)
        sectioned: Optional[SectionedRows] = None,  # multimodal RoPE's image rows (with hidden_states: their embeds)
    ) -> torch.Tensor:
        built: dict[tuple[int, Optional[int]], Any] = {}
        for key in layer_keys:
            if key not in built:
                group, chunk = key
                step = steps[group] if chunk is None else local_chunks(steps[group], chunk, block_size)
                built[key] = backend.build_metadata(step, kv_cache.spec)
        metadata = [built[key] for key in layer_keys]
        before = model.lora_step
        if lora_step is not None:
            model.lora_step = lora_step
        try:
            if hidden_states is None:
                return model.forward(input_ids, positions, kv_cache.layers, metadata, backend)
            if sectioned is not None:
                return model.forward(input_ids, positions, kv_cache.layers, metadata, backend, hidden_states, sectioned)
            return model.forward(input_ids, positions, kv_cache.layers, metadata, backend, hidden_states)
        finally:
            model.lora_step = before

    return forward


class DecodeGraphs:
    """The decode graphs of one runner: `pad(num_decodes)` before the step's inputs are uploaded
    (it fills the padding rows and says how many rows to upload), then `replay(bucket)`."""

    def __init__(
        self,
        forward: ForwardFn,
        backend: AttentionBackend,
        kv_cache: KVCache,
        buffers: StepBuffers,
        buckets: tuple[int, ...],
        max_model_len: int,
        graph_type: type = CudaGraph,
        lora: Optional[LoRAStack] = None,
        tapped: Optional[Callable[[], dict[int, torch.Tensor]]] = None,
    ):
        """`lora`: the model's adapter slots (LoRA enabled): each graph is captured with static LoRA inputs.
        `tapped`: the model's features of its last forward (EAGLE-3's layers: `LlamaForCausalLM.tapped_features`),
        which each graph copies into static buffers of its own (`tapped_of` after a replay)."""
        if buckets[-1] > buffers.max_num_reqs:
            raise ValueError(f"bucket {buckets[-1]} exceeds the step buffers' {buffers.max_num_reqs} requests")
        self.forward: Optional[ForwardFn] = forward  # None once released
        self.backend = backend
        self.kv_cache = kv_cache
        self.buffers = buffers
        self.buckets = buckets
        self.max_model_len = max_model_len
        self.graph_type = graph_type
        self.width = buffers.max_blocks_per_req
        self.pad_slot = kv_cache.pad_block * kv_cache.spec.block_size
        self.num_groups = len(kv_cache.spec.groups)
        self._graphs: dict[int, Graph] = {}
        self.lora = lora
        self._lora_inputs = {} if lora is None else {size: LoRAGraphInputs(lora, size) for size in buckets}
        self.tapped = tapped
        self._tapped: dict[int, dict[int, torch.Tensor]] = {}  # bucket -> layer -> its static [bucket, hidden]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def describe(self) -> str:
        if not self._graphs:
            return "off"
        sizes = self.sizes
        return f"decode batches {sizes[0]}-{sizes[-1]} ({len(sizes)} sizes)"

    def bucket_for(self, num_decodes: int) -> Optional[int]:
        return bucket_for(self.sizes, num_decodes)

    def takes_lora(self, segments: Sequence[LoRASegment]) -> bool:
        """Whether a decode step of these LoRA segments can replay (graphs captured with LoRA, no adapter of it
        replacing the embedding)."""
        return self.lora is not None and LoRAGraphInputs.takes(self.lora, segments)

    def fill_lora(self, bucket: int, segments: Sequence[LoRASegment]) -> LoRAStep:
        """Write a step's LoRA segments into the bucket's static inputs: the LoRAStep its graph replays."""
        return self._lora_inputs[bucket].fill(segments)

    def release(self) -> None:
        """Free every graph (their memory pool goes with the last one)."""
        for graph in self._graphs.values():
            graph.release()
        self._graphs.clear()
        self._lora_inputs.clear()
        self._tapped.clear()
        self.forward = None

    # ------------------------------------------------------------------ capture

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool."""
        started = time.monotonic()
        on_cuda = self.graph_type is CudaGraph
        pool = torch.cuda.graph_pool_handle() if on_cuda else None
        stream = torch.cuda.Stream() if on_cuda else None  # warm-ups and captures: library workspaces
        gc.collect()  # are per stream, so made outside the graphs
        for size in sorted(self.buckets, reverse=True):
            forward = self._step_fn(size)
            self._write_padding(0, size)
            self.buffers.upload_all(size, self.width)
            if stream is not None:  # on CUDA
                torch.cuda.synchronize()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    forward()  # warm-up: compiles kernels, allocates workspaces and any backend buffers
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
            else:
                forward()
            self._graphs[size] = self.graph_type(forward, pool, stream)
        if on_cuda:
            torch.cuda.synchronize()
        logger.info(
            "captured %d decode graphs (batch sizes %d-%d) in %.1f s",
            len(self._graphs),
            min(self.buckets),
            max(self.buckets),
            time.monotonic() - started,
        )

    def _step_fn(self, size: int) -> Callable[[], torch.Tensor]:
        """The step of `size` decode rows over the persistent buffers (views fixed now, values read at run)."""
        buffers = self.buffers
        steps = [
            StepMetadata(
                slot_mapping=buffers.slot_mappings[group].device[:size],
                query_start_loc=buffers.query_start_loc.device[: size + 1],
                seq_lens=buffers.seq_lens.device[:size],
                block_table=buffers.block_tables[group].device[: size * self.width].view(size, self.width),
                query_start_loc_cpu=buffers.query_start_loc.host[: size + 1],
                seq_lens_cpu=buffers.seq_lens.host[:size],
                num_decodes=size,
                max_query_len=1,
                max_seq_len=self.max_model_len,
            )
            for group in range(self.num_groups)
        ]
        input_ids = buffers.input_ids.device[:size]
        positions = buffers.positions.device[:size]
        forward = self.forward
        assert forward is not None  # not released (capture comes before release)
        lora = self._lora_inputs.get(size)
        if lora is not None:
            lora.fill(())  # (captured with no slot for any row: a zero delta)
        lora_step = None if lora is None else lora.step

        tapped, statics = self.tapped, self._tapped

        def run() -> torch.Tensor:
            hidden = forward(input_ids, positions, steps, lora_step=lora_step)
            if tapped is not None:
                # copied into buffers made at the first run (the warm-up, outside the graph), so that the captured
                # graph rewrites them at each replay
                taps = tapped()
                static = statics.setdefault(size, {layer: torch.empty_like(t[:size]) for layer, t in taps.items()})
                for layer, tensor in taps.items():
                    static[layer].copy_(tensor[:size])
            return hidden

        return run

    # ------------------------------------------------------------------ a step

    def pad(self, num_decodes: int, bucket: int) -> None:
        """Fill rows num_decodes .. bucket - 1 of the host buffers with padding (after the real rows:
        the block table's real rows must already be written at this graph's width)."""
        self._write_padding(num_decodes, bucket)

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the bucket's graph over what was uploaded; its output is valid until the next replay."""
        return self._graphs[bucket].replay()

    def tapped_of(self, bucket: int) -> dict[int, torch.Tensor]:
        """The features the bucket's last replay tapped (with `tapped`), valid until the next replay."""
        return self._tapped[bucket]

    def _write_padding(self, start: int, end: int) -> None:
        if start >= end:
            return
        buffers = self.buffers
        buffers.input_ids.array[start:end] = 0
        buffers.positions.array[start:end] = 0
        buffers.seq_lens.array[start:end] = 1
        buffers.query_start_loc.array[start : end + 1] = np.arange(start, end + 1)
        for slots, table in zip(buffers.slot_mappings, buffers.block_tables):
            slots.array[start:end] = self.pad_slot
            table.array[: end * self.width].reshape(end, self.width)[start:end] = self.kv_cache.pad_block
