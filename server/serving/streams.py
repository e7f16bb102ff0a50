"""A request's engine streams, read as one: interleaved, bounded by the request's deadline, closed (aborting
what still runs) whenever the response ends, however it ends."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncGenerator, AsyncIterator, Optional, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.outputs import OutputAccumulator, RequestOutput
from engine.request_stream import RequestStream
from server.http.errors import APIError
from server.serving.choices import Choice
from server.serving.disconnect import cancel_on_disconnect
from server.serving.request_guard import RequestGuard, RequestTimeoutError


async def stream_choices(
    choices: Sequence[Choice],
    streams: Sequence[RequestStream],
    *,
    guard: Optional[RequestGuard] = None,
    interval: int = 1,
) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Interleave the outputs of every choice as they come. Ending or closing this iterator closes every
    stream, which aborts the choices still running. With a `guard`, each choice's first output frees its
    place in the queue, and passing the deadline raises RequestTimeoutError (504). With `interval` n > 1
    (vLLM's --stream-interval), a choice's outputs after its first are held and joined until they hold n new
    tokens or it finishes: fewer, larger chunks."""
    held: dict[str, RequestOutput] = {}  # a choice's outputs not yet sent, joined
    sent: set[str] = set()  # choices that sent their first output
    if len(choices) == 1:  # nothing to interleave: read the engine's stream directly
        items: AsyncGenerator[tuple[Choice, RequestOutput], None] = _single(choices[0], streams[0])
    else:
        items = _interleave(choices, streams)
    try:
        async with contextlib.aclosing(items):
            while True:
                try:
                    choice, output = await _next(items, None if guard is None else guard.deadline)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:  # only a guard sets a deadline
                    assert guard is not None
                    guard.timed_out(streams)
                    raise RequestTimeoutError(guard.timeout) from None
                if guard is not None:
                    guard.started(choice.request_id)
                if output.error is not None:
                    raise GenerationFailedError(output.error)
                if interval > 1:
                    earlier = held.pop(choice.request_id, None)
                    if earlier is not None:
                        output = earlier.then(output)
                    if choice.request_id in sent and not output.finished and len(output.new_token_ids) < interval:
                        held[choice.request_id] = output
                        continue
                    sent.add(choice.request_id)
                yield choice, output
    finally:
        await close_streams(streams)
        if guard is not None:
            guard.release()


async def _next(items: AsyncIterator, deadline: Optional[float]):
    if deadline is None:
        return await items.__anext__()
    return await asyncio.wait_for(items.__anext__(), max(deadline - time.monotonic(), 0.0))


async def _single(choice: Choice, stream: RequestStream) -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
    async for output in stream:
        yield choice, output


class GenerationFailedError(APIError):
    """The engine failed this request alone (its sampling or its text); the other requests go on."""

    def __init__(self, reason: str):
        super().__init__(500, f"generating this completion failed: {reason}", code="generation_failed")


class ChoicesStreamingResponse(StreamingResponse):
    """An SSE response that owns its choices' engine streams: whenever the response ends (sent,
    failed, or never started because the client left before the headers went out) it closes them,
    aborting the choices still running. A plain StreamingResponse whose body generator never
    starts would leave them to run to max_tokens for nobody."""

    def __init__(self, content: AsyncIterator[bytes], streams: Sequence[RequestStream], guard: RequestGuard):
        super().__init__(content, media_type="text/event-stream")
        self._streams = streams
        self._guard = guard

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_streams(self._streams)  # never suspends: completes even when cancelled
            self._guard.release()


async def close_streams(streams: Sequence[RequestStream]) -> None:
    """Let go of every stream, aborting the choices still running (closing twice is harmless)."""
    for stream in streams:
        await stream.aclose()


async def _interleave(
    choices: Sequence[Choice], streams: Sequence[RequestStream]
) -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: Choice, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((choice, output))
                # let the other choices' pumps take a turn: a stream whose outputs are already waiting (the
                # engine ahead of this loop) would otherwise be drained whole before the next choice's first
                await asyncio.sleep(0)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(exc)
            return
        queue.put_nowait(done)

    tasks = [asyncio.create_task(pump(choice, stream)) for choice, stream in zip(choices, streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_choices(
    choices: Sequence[Choice], streams: Sequence[RequestStream], guard: Optional[RequestGuard] = None
) -> list[OutputAccumulator]:
    results = {choice.request_id: OutputAccumulator() for choice in choices}
    async for choice, output in stream_choices(choices, streams, guard=guard):
        results[choice.request_id].add(output)
    return list(results.values())


async def collect_or_cancel(
    request: Request, choices: Sequence[Choice], streams: Sequence[RequestStream], guard: RequestGuard
) -> list[OutputAccumulator]:
    """A non-streamed response's results: every choice collected (all aborted if the client leaves first),
    then the streams closed and the guard released, whatever happened."""
    try:
        return await cancel_on_disconnect(request, collect_choices(choices, streams, guard))
    finally:
        await close_streams(streams)
        guard.release()
