"""A request's choices read as one stream (server/serving/streams.py): interleaved even when the engine has run
ahead of the event loop and every choice's outputs are already waiting."""

from __future__ import annotations

import asyncio

from engine.outputs import RequestMetrics, RequestOutput
from engine.request_stream import RequestStream
from engine.sampling.params import SamplingParams
from server.serving.choices import Choice
from server.serving.streams import stream_choices


def _output(request_id: str, step: int, last: bool) -> RequestOutput:
    metrics = RequestMetrics(
        arrival_time=0.0,
        first_scheduled_time=0.0,
        first_token_time=0.0,
        last_token_time=float(step),
        finished_time=float(step) if last else None,
    )
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[step],
        text_delta=f"t{step}",
        text="",
        finish_reason="length" if last else None,
        stop_reason=None,
        num_prompt_tokens=3,
        num_output_tokens=step + 1,
        num_cached_tokens=0,
        metrics=metrics,
    )


def test_choices_whose_outputs_all_wait_come_interleaved():
    async def read() -> list[tuple[int, int]]:
        choices = [Choice(i, f"req-{i}", 0, [1, 2, 3], SamplingParams(max_tokens=4)) for i in range(3)]
        streams = [RequestStream(c.request_id, c.request_id, lambda stream, reason: None) for c in choices]
        for choice, stream in zip(choices, streams):  # the engine finished every choice before anyone read
            for step in range(4):
                stream.put(_output(choice.request_id, step, last=step == 3))
        return [(choice.index, output.new_token_ids[0]) async for choice, output in stream_choices(choices, streams)]

    order = asyncio.run(read())
    assert order == [(index, step) for step in range(4) for index in range(3)]  # round robin, each in its order
