"""POST /pooling (vLLM's Pooling API): what a pooling model computes for each input, whatever its task: an
embedding model's embedding, a classification model's class scores. The request is /v1/embeddings' (`input` or
chat-style `messages`, `dimensions`, `normalize`, `encoding_format`, ...) with /classify's `use_activation`; it
goes through the serving pipeline as those do."""

from __future__ import annotations

import time
from typing import Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from engine.errors import RequestRejectedError
from engine.pooling.params import PoolingParams
from server.http.errors import ERROR_RESPONSES, rejection_error
from server.openai.embeddings import EmbeddingRequest, encoded, prompt_of
from server.openai.protocol import PoolingUsage, new_id, now
from server.serving.pipeline import PoolingRequest, start_pooling
from server.state import ServerState

router = APIRouter()


class PoolingApiRequest(EmbeddingRequest):
    use_activation: Optional[bool] = None  # a classification model's: false gives the raw logits


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: Union[list[float], str]


class PoolingResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


@router.post("/pooling", response_model=PoolingResponse, responses=ERROR_RESPONSES)
async def create_pooling(body: PoolingApiRequest, request: Request) -> PoolingResponse:
    arrival_time = time.monotonic()
    state: ServerState = request.app.state.server
    try:
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize, use_activation=body.use_activation)
    except RequestRejectedError as exc:
        raise rejection_error(exc) from None
    generation = await start_pooling(
        state,
        PoolingRequest(
            body=body,
            model=body.model,
            request_id=body.request_id or new_id("pool"),
            prompt=prompt_of(body),
            params=params,
            priority=body.priority,
            cache_salt=body.cache_salt,
            field_names={"prompt": "messages" if body.messages is not None else "input"},
            api="Pooling API",
            tasks=("embed", "classify"),
        ),
        arrival_time,
    )
    results = await generation.collect(request)
    data = []
    for choice, result in zip(generation.choices, results):
        assert result.embedding is not None  # (a request that failed raised in collect)
        data.append(PoolingData(index=choice.index, data=encoded(result.embedding, body)))
    return PoolingResponse(
        id=generation.request_id,
        model=generation.model,
        data=data,
        usage=PoolingUsage.of(generation.num_prompt_tokens),
    )
