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


def test_a_stream_interval_joins_outputs_after_the_first(tiny_model_dir):
    """--stream-interval 4 on a real server: each choice's first token alone, then chunks of 4 new tokens, the rest
    with its finish; the text, tokens and logprobs the same as per token."""
    from server.config.server_config import ServerConfig
    from tests.server.conftest import serving

    body = {"prompt": "Hello there", "max_tokens": 10, "temperature": 0, "logprobs": 1, "n": 2}
    with serving(tiny_model_dir, ServerConfig(stream_interval=4)) as running:
        sdk = running.sdk()
        extra = {"ignore_eos": True}
        whole = sdk.completions.create(model=running.model_name, extra_body=extra, **body)
        chunks = list(sdk.completions.create(model=running.model_name, stream=True, extra_body=extra, **body))
        running.wait_idle()
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert [len(c.logprobs.tokens) for c in mine] == [1, 4, 4, 1]
        assert "".join(c.text for c in mine) == whole.choices[index].text
        assert [t for c in mine for t in c.logprobs.tokens] == whole.choices[index].logprobs.tokens
        assert mine[-1].finish_reason == "length" and all(c.finish_reason is None for c in mine[:-1])
