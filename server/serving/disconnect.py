"""Abort the work of a non-streaming request as soon as its client goes away."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from fastapi import Request

from server.http.errors import APIError

T = TypeVar("T")


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "client disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
