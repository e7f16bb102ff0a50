"""A pipeline stage's runner: the model runner over this stage's layers, its input and output passed along the
pipeline (engine/distributed/pipeline_link.py).

Stage 0 (the engine's process) splits a step in two, so that several steps are in flight at once:

    launch(step A): the step message to the other ranks, the embedding and stage 0's layers, hidden states on
    launch(step B): ...                       while stage 1 runs step A's layers
    finish(A):      the last stage's hidden states for A's rows back, the LM head, sampling -> A's tokens

The scheduler never puts a request in two steps in flight, so A's requests are untouched by B's launch. A later
stage runs each step whole (`execute`): its hidden states in, its layers, its hidden states out (the last stage
sends only the rows stage 0 samples, or every row when the step scores prompt tokens).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from engine.distributed.pipeline_link import PipelineLink
from engine.outputs import ModelRunnerOutput
from engine.runner.model_runner import ModelRunner
from engine.runner.peer_step import FinishStep, PeerStep
from scheduler import SchedulerOutput


class LaunchedStep(NamedTuple):
    """A step stage 0 launched: what it samples once the last stage's hidden states are back."""

    step_id: int
    batch: Any  # the runner's _Batch; None for a step that ran no forward pass


def returns_every_row(batch: Any) -> bool:
    """Whether the last stage sends back every row of a step (it scores prompt rows or pools rows), not only the
    sample rows. (A pooling request's last chunk may pool no row, as CLS's past its first: it needs none.)"""
    return bool(batch.prompt_rows) or any(count for _, _, count, _ in batch.pool_rows)


def returned_rows(batch: Any) -> int:
    """The rows the last stage sends back for a step: the sample rows, or every row (`returns_every_row`)."""
    return batch.num_tokens if returns_every_row(batch) else len(batch.sample_rows)


class PipelineRunner(ModelRunner):
    """The runner of one pipeline stage (and tensor-parallel rank): `pipeline` links it to the stages around."""

    def __init__(self, *args: Any, pipeline: PipelineLink, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pipeline = pipeline

    @property
    def stage(self):
        return self.pipeline.stage

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Stage 0: the step launched and finished at once (one step in flight). A later stage: the step's layers."""
        if self.stage.is_first:
            return self.finish(self.launch(scheduler_output))
        self._run_stage(scheduler_output)
        return ModelRunnerOutput()

    # ------------------------------------------------------------------ stage 0

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        peers = self.peers
        if peers is not None:
            peers.send(PeerStep(scheduler_output, self._sampled))
            self._sampled = {}
        try:
            return LaunchedStep(scheduler_output.step_id, self._launch(scheduler_output))
        except BaseException as error:
            if peers is not None:
                peers.fail(error)
            raise

    def _launch(self, scheduler_output: SchedulerOutput) -> Optional[Any]:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return None
        buffers, forward, model = self.buffers, self._forward, self.model
        assert buffers is not None and forward is not None and model is not None  # not shut down
        buffers.begin_step()
        try:
            batch, steps, _ = self._prepare_inputs(scheduler_output)  # (no decode graphs in a pipeline)
            model.lora_step, model.recurrent_step = batch.lora, batch.recurrent
            hidden = forward(
                buffers.input_ids.upload(batch.num_tokens), buffers.positions.upload(batch.num_tokens), steps
            )
            self._save_after_forward(scheduler_output)
            self.pipeline.send_forward(hidden)
        finally:
            model.lora_step = model.recurrent_step = None
            buffers.end_step()
        return batch

    @torch.inference_mode()
    def finish(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Sample the launched step from the last stage's hidden states (steps finish in the order launched)."""
        peers = self.peers
        if peers is not None and launched.batch is not None and self.model is not None and self.model.tp.is_parallel:
            peers.send(FinishStep(launched.step_id))  # stage 0's peers gather their logits slices alongside
        try:
            return self._finish(launched.batch)
        except BaseException as error:
            if peers is not None:
                peers.fail(error)
            raise

    def _finish(self, batch: Optional[Any]) -> ModelRunnerOutput:
        if batch is None:
            return ModelRunnerOutput()
        if returned_rows(batch) == 0:  # prompt chunks short of their end: nothing to sample, score or pool
            # ... but a pooling prompt may still end here with no row to pool (CLS past its first chunk): its
            # vector is the rows it pooled in earlier steps
            ends = self.samples and any(last for *_, last in batch.pool_rows)
            return ModelRunnerOutput(pooled=self._pool(None, batch)) if ends else ModelRunnerOutput()
        hidden = self.pipeline.receive(returned_rows(batch))
        selected = not returns_every_row(batch)
        if not self.samples:
            self._contribute_logits(hidden, batch, selected)
            return ModelRunnerOutput()
        output = self._sample(hidden, batch, selected)
        if self.peers is not None:
            self._sampled.update(output.sampled_token_ids)  # (several steps may finish between two launches)
        return output

    # ------------------------------------------------------------------ later stages

    def _run_stage(self, scheduler_output: SchedulerOutput) -> None:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return
        buffers, forward, model = self.buffers, self._forward, self.model
        assert buffers is not None and forward is not None and model is not None  # not shut down
        buffers.begin_step()
        try:
            batch, steps, _ = self._prepare_inputs(scheduler_output)
            model.lora_step, model.recurrent_step = batch.lora, batch.recurrent
            arrived = self.pipeline.receive(batch.num_tokens)
            hidden = forward(
                buffers.input_ids.upload(batch.num_tokens),
                buffers.positions.upload(batch.num_tokens),
                steps,
                arrived,
            )
            self._save_after_forward(scheduler_output)
            if not self.stage.is_last:
                self.pipeline.send_forward(hidden)
            elif returned_rows(batch):
                self.pipeline.send_forward(hidden if returns_every_row(batch) else self._sample_hidden(hidden, batch))
        finally:
            model.lora_step = model.recurrent_step = None
            buffers.end_step()
