"""Reading a streamed response as the exact SSE frames the OpenAI API sends."""

from __future__ import annotations

import json


def parse_sse(response) -> list[dict]:
    """Check the exact SSE framing (`data: {json}\\n\\n` frames, `data: [DONE]` last); the payloads."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.text
    assert raw.endswith("data: [DONE]\n\n")
    frames = raw.split("\n\n")
    assert frames[-1] == ""  # every frame, the last included, ends with a blank line
    frames = frames[:-1]
    assert frames[-1] == "data: [DONE]"
    payloads = []
    for frame in frames[:-1]:
        assert frame.startswith("data: ") and "\n" not in frame, frame
        payloads.append(json.loads(frame[len("data: ") :]))
    return payloads


def stream_raw(server, path: str, **body) -> list[dict]:
    """POST `body` with stream=True (model "tiny") and return the parsed payloads."""
    with server.client() as c:
        return parse_sse(c.post(path, json={"model": "tiny", "stream": True, **body}))
