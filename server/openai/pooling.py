"""POST /pooling (vLLM's Pooling API): what a pooling model computes for each input, whatever its task: an
embedding model's embedding, a classification model's class scores. The request is /v1/embeddings' (`input` or
chat-style `messages`, `dimensions`, `normalize`, `encoding_format`, ...) with /classify's `use_activation`; it
goes through the serving pipeline as those do."""

from __future__ import annotations

from typing import Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from server.http.errors import ERROR_RESPONSES
from server.openai.embeddings import EmbeddingRequest, encoded, pool_inputs
from server.openai.protocol import PoolingUsage, new_id, now

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
    generation, vectors = await pool_inputs(
        body,
        request,
        "pool",
        api="Pooling API",
        tasks=("embed", "classify"),
        use_activation=body.use_activation,
    )
    return PoolingResponse(
        id=generation.request_id,
        model=generation.model,
        data=[PoolingData(index=i, data=encoded(vector, body)) for i, vector in vectors],
        usage=PoolingUsage.of(generation.num_prompt_tokens),
    )
