"""One benchmark request: streamed, with the time of every content chunk.

TTFT      send -> first chunk carrying content (text, or a chat delta's content)
ITL       the gaps between consecutive content chunks
latency   send -> end of the stream
output    completion tokens from the final usage chunk (`stream_options.include_usage`); without
          one, the number of content chunks

An embeddings request (`--endpoint /v1/embeddings`) is not streamed: its TTFT and latency are both the time to
its answer, and it outputs no tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx

from server.benchmark.datasets import BenchRequest


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's count (usage), else the dataset's
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float = 0.0  # seconds
    start: float = 0.0  # perf_counter at send


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how to send: the route, the model name, and the request options every request shares."""

    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat", "embeddings"
    ignore_eos: bool = False
    api_key: Optional[str] = None
    temperature: float = 0.0
    extra_body: Optional[dict] = None

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]

    def body(self, request: BenchRequest) -> dict:
        if self.endpoint == "embeddings":
            return {"model": self.model, "input": request.prompt, **(self.extra_body or {})}
        body: dict = {
            "model": self.model,
            "max_tokens": request.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body or {})
        return body

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _content(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


Clock = Callable[[], float]
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "embeddings": "/v1/embeddings"}


async def send(
    client: httpx.AsyncClient, target: Target, request: BenchRequest, clock: Clock = time.perf_counter
) -> RequestResult:
    """Send one request and time its stream with `clock` (read at send, at every chunk, at the end);
    failures are recorded, never raised."""
    if target.endpoint == "embeddings":
        return await _send_unstreamed(client, target, request, clock)
    result = RequestResult(prompt_len=request.prompt_len)
    chunks = 0
    usage = None
    result.start = last = clock()
    try:
        async with client.stream("POST", target.url, json=target.body(request), headers=target.headers()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return result
                now = clock()
                if _content(chunk, target.endpoint):
                    if chunks == 0:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = clock() - result.start
    if chunks == 0:
        result.error = "no content in the stream"
        return result
    result.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    if usage and usage.get("prompt_tokens"):
        result.prompt_len = int(usage["prompt_tokens"])
    result.success = True
    return result


async def _send_unstreamed(
    client: httpx.AsyncClient, target: Target, request: BenchRequest, clock: Clock
) -> RequestResult:
    """An embeddings request: one answer, its time both the TTFT and the latency."""
    result = RequestResult(prompt_len=request.prompt_len)
    result.start = clock()
    try:
        response = await client.post(target.url, json=target.body(request), headers=target.headers())
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:300]}"
            return result
        usage = response.json().get("usage") or {}
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = result.ttft = clock() - result.start
    if usage.get("prompt_tokens"):
        result.prompt_len = int(usage["prompt_tokens"])
    result.success = True
    return result
